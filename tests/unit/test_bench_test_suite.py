"""The test-suite benchmark reads pytest's output: its counts and clock, the slowest tests, the failures."""

from __future__ import annotations

import pytest

from bench.test_suite import parse_pytest

OUT = """........s...F...
=================================== FAILURES ===================================
____________________________ test_one_thing_fails _____________________________
tests/unit/test_x.py:3: AssertionError
============================= slowest 25 durations =============================
93.01s call     tests/e2e/test_cli.py::test_train
0.51s setup    tests/unit/test_x.py::test_a
12.30s call     tests/e2e/test_slurm_run.py::test_b[2]
=========================== short test summary info ============================
SKIPPED [1] tests/unit/test_y.py:9: needs a GPU
1 failed, 1571 passed, 29 skipped, 2 warnings in 426.12s (0:07:06)
"""


def test_counts_clock_slowest_and_failures():
    r = parse_pytest(OUT)
    assert r["counts"] == {"failed": 1, "passed": 1571, "skipped": 29, "warnings": 2}
    assert r["pytest_s"] == 426.12
    assert [d["test"] for d in r["slowest"]] == [
        "tests/e2e/test_cli.py::test_train",
        "tests/e2e/test_slurm_run.py::test_b[2]",
        "tests/unit/test_x.py::test_a",
    ]
    assert r["slowest"][0] == {"s": 93.01, "phase": "call", "test": "tests/e2e/test_cli.py::test_train"}
    assert r["failed"] == ["test_one_thing_fails"]


def test_the_last_summary_line_counts_and_a_missing_one_is_an_error():
    r = parse_pytest("3 passed in 1.00s\n...\n== 5 passed, 1 skipped in 2.50s ==\n")
    assert r["counts"] == {"passed": 5, "skipped": 1} and r["pytest_s"] == 2.5 and r["failed"] == []
    with pytest.raises(ValueError, match="no pytest summary line"):
        parse_pytest("ruff: 3 errors\n")


def _probe_answers(monkeypatch, capabilities: dict[str | None, str]) -> None:
    """The CPU kind probe answering ``capabilities`` per emulation (None: this CPU's own kernels)."""
    import bench.demo
    import bench.test_suite

    for module in (bench.demo, bench.test_suite):
        monkeypatch.setattr(module, "emulation_env", lambda emulated, env: {"EMULATED": emulated})
        monkeypatch.setattr(module, "_kind", lambda env: {"aten_capability": capabilities[env["EMULATED"]]})


def test_an_avx512_cpu_runs_its_own_kernels_then_the_avx2_emulation(monkeypatch):
    from bench.demo import kernel_sets

    _probe_answers(monkeypatch, {None: "AVX512", "avx2": "AVX2"})
    assert kernel_sets(quick=False) == ({"this CPU's": None, "AVX2 only (emulated)": "avx2"}, None)
    assert kernel_sets(quick=True) == ({"this CPU's": None}, None)


def test_an_avx2_only_cpu_leaves_out_the_emulation_that_would_repeat_its_own_run(monkeypatch, tmp_path):
    import bench.test_suite as ts

    _probe_answers(monkeypatch, {None: "AVX2", "avx2": "AVX2"})
    ran = []

    def suite(target, env, log_path):
        ran.append(env["EMULATED"])
        return {
            "command_s": 1.0,
            "pytest_s": 1.0,
            "counts": {"passed": 1},
            "exit_status": 0,
            "failed": [],
            "load_avg_1m": [0.1, 0.2],
        }

    monkeypatch.setattr(ts, "run_suite", suite)
    monkeypatch.setattr(ts, "RUNS_DIR", tmp_path)
    r = ts.run(quick=False)
    assert ran == [None] and len(r["rows"]) == 1
    assert r["left_out"] == "AVX2 only (emulated): this CPU's own kernels are AVX2 already"
