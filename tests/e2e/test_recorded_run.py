"""A run recorded once, in the repository (tests/data/recorded_run), replayed wherever the suite runs.

On the CPU kind and kernels that recorded it, the replay must reproduce every checkpoint bit for bit.
Anywhere else this is a cross-kind replay: ``--tolerant`` trains all ten steps, and the weights may
drift only by rounding (relative L2 distance under 1e-5 after ten steps; measured ~2e-8 between
AVX-512 and AVX2 kernels on one CPU). A second replay in a subprocess with other vector kernels
(``ATEN_CPU_CAPABILITY``) makes every run of the suite a cross-kernel replay too. The test's output
names the kind that recorded the run and the kind replaying it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.numerics import cpu_kind, kind_label, same_kernels
from flows.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests/data/recorded_run"
DRIFT = 1e-5  # relative L2 distance of the final weights a faithful cross-kind replay stays under


def _recorded_on() -> dict:
    return json.loads((RECORDED / "schedule/meta.json").read_text())["numerics"]


def _check(summary: dict, exact: bool) -> None:
    assert [c["version"] for c in summary["checkpoints"]] == [5, 10]
    if exact:
        assert summary["all_match"], summary["checkpoints"]
        return
    for c in summary["checkpoints"]:  # the same, or off by rounding only
        assert c["match"] or c["weights"]["relative_l2"] < DRIFT, c
    if not summary["all_match"]:
        assert summary["first_difference"]["step"] >= 1 and summary["final_distance"]["relative_l2"] < DRIFT


def test_the_recorded_run_replays_here(tmp_path, capsys):
    recorded, here = _recorded_on(), cpu_kind()
    exact = same_kernels(recorded, here)
    rc = main(
        ["replay", str(RECORDED), "--out", str(tmp_path / "r"), "--no-prefect", *([] if exact else ["--tolerant"])]
    )
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    with capsys.disabled():
        print(
            f"\nrecorded run: recorded on {kind_label(recorded)}; replayed on {kind_label(here)}: "
            + ("every checkpoint bit for bit" if summary["all_match"] else f"drift {summary['final_distance']}")
        )
    assert rc == (0 if summary["all_match"] else 1)
    _check(summary, exact)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs /proc/cpuinfo")
def test_the_recorded_run_replays_on_other_vector_kernels(tmp_path, capsys):
    here = cpu_kind()["aten_capability"]
    other = "avx2" if here == "AVX512" else "default"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": other}
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "flows.cli", "replay", str(RECORDED), "--out", str(out), "--no-prefect", "--tolerant"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    with capsys.disabled():
        print(f"\nrecorded run replayed on {kind_label(summary['replayed_on'])}: " + r.stdout.splitlines()[-2])
    assert summary["replayed_on"]["aten_capability"] == other.upper()
    assert r.returncode == (0 if summary["all_match"] else 1), r.stderr[-2000:]
    _check(summary, exact=False)
