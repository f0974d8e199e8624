"""Load, at CI size: 200 concurrent generate requests on one embedded server (twice, memory
bounded) and 1,000 grading tasks. bench/load_test.py runs the full 1,000 / 10,000."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("load_test", Path(__file__).parents[2] / "bench/load_test.py")
load_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_test)

pytestmark = pytest.mark.nightly  # load, not behaviour: make test-nightly (CI runs it)


@pytest.mark.slow
def test_concurrent_generate_requests(tmp_path):
    n = 200
    out = load_test.generate_load(
        load_test.tiny_model_dir(str(tmp_path / "m")), n, max_new_tokens=8, rounds=2, max_running=64
    )
    assert out["server_alive"]
    for r in out["rounds"]:
        assert r["errors"] == 0 and r["ok"] == n, r
    first, last = out["rounds"]
    assert last["rss_peak_mb"] <= first["rss_peak_mb"] + 16, out  # a second round does not grow it


@pytest.mark.slow
def test_reward_service_takes_many_tasks():
    out = load_test.reward_load(1000)
    assert out["finished"] and out["completed"] == 1000 and out["errors"] == 0, out
    assert out["correct"] == 500
