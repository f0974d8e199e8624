"""The core-interference benchmark's driver: two pinned workers, the second really looping beside the first."""

from __future__ import annotations

import os

import pytest
import torch

from bench import core_interference

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def test_every_kernel_the_pairs_name_is_built_at_its_shape():
    names = {n for pair in core_interference.PAIRS for n in pair} - {"memory traffic"}
    for name in names:
        out = core_interference.kernel(name)()
        rows = 1024 if "trainer" in name else 64
        assert out.shape == (rows, 1536)
        assert out.dtype == (torch.bfloat16 if name.startswith("bf16") else torch.float32)


def test_the_second_cpu_loops_for_as_long_as_the_first_is_timed(monkeypatch):
    monkeypatch.setattr(core_interference, "PAIRS", (("float32 products (decode)", "float32 products (decode)"),))
    pair = core_interference.Pair()
    try:
        assert len(set(pair.cpus)) == 2
        seconds, looped = pair.beside("float32 products (decode)", 200, "float32 products (decode)")
        assert seconds > 0 and looped > 0  # the second worker ran its kernel meanwhile
        (row,) = core_interference.measure(pair, 2, 0.02)
    finally:
        pair.close()
    assert all(not p.is_alive() for p in pair.procs)
    assert row["iterations"] >= 1 and len(row["alone_ms"]) == len(row["beside_ms"]) == 2
    assert row["slowdowns"] == pytest.approx([b / a for a, b in zip(row["alone_ms"], row["beside_ms"])])
    assert row["slowdown"] == pytest.approx(sum(row["slowdowns"]) / 2)  # the median of two
