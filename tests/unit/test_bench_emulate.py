"""``python -m bench NAME --emulate KIND``: the benchmark runs again in a process started with the
emulated kernels, and its record goes beside the record of this CPU's own kernels."""

from __future__ import annotations

import json
import sys
import types

import pytest

import bench.__main__ as bench_main
from areal_core.numerics import EMULATIONS


class _Started(Exception):
    pass


def test_emulate_starts_the_benchmark_again_with_the_kinds_kernels(monkeypatch):
    started = {}

    def execve(path, argv, env):
        started.update(path=path, argv=argv, env=env)
        raise _Started

    monkeypatch.setattr(bench_main.os, "execve", execve)
    monkeypatch.delenv(bench_main.EMULATING, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    with pytest.raises(_Started):
        bench_main.main(["engine", "--emulate", "avx2", "--quick"])
    assert started["argv"][1:] == ["-m", "bench", "engine", "--emulate", "avx2", "--quick"]
    env = started["env"]
    assert {k: env[k] for k in EMULATIONS["avx2"][1]} == EMULATIONS["avx2"][1]
    assert env[bench_main.EMULATING] == "avx2"


def test_emulate_is_refused_with_all_and_does_not_start_again(monkeypatch):
    monkeypatch.setattr(bench_main.os, "execve", lambda *a: pytest.fail("started again"))
    with pytest.raises(SystemExit):
        bench_main.main(["all", "--emulate", "avx2"])


def test_an_emulated_run_is_recorded_beside_this_cpus_own(monkeypatch, tmp_path):
    fake = types.ModuleType("bench.fake")
    fake.run = lambda quick: {"summary": {"fake_ratio": 1.5}}
    monkeypatch.setitem(sys.modules, "bench.fake", fake)
    monkeypatch.setattr(bench_main, "results_dir", lambda quick: tmp_path)
    bench_main.run_one("fake", False)
    bench_main.run_one("fake", False, emulate="avx2")
    assert sorted(p.name for p in tmp_path.glob("fake*.json")) == ["fake.emulated-avx2.json", "fake.json"]
    r = json.loads((tmp_path / "fake.emulated-avx2.json").read_text())
    assert r["benchmark"] == "fake" and r["command"] == "python -m bench fake --emulate avx2"
    assert json.loads((tmp_path / "fake.json").read_text())["command"] == "python -m bench fake"
