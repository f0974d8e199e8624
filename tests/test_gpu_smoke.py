"""infra/gpu_smoke.py, the script for the first GPU machine, run here on the CPU with the tiny
model: it completes, its JSON has every figure, and the megatron step agrees with the torch one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra; make setup)")

from infra.gpu_smoke import main  # noqa: E402

HERE = Path(__file__).parent


@pytest.mark.slow
def test_gpu_smoke_runs_on_the_cpu(tmp_path, capsys):
    assert main(["--model", "tiny", "--config", str(HERE / "data/e2e.yaml"), "--steps", "2", "--eval-problems", "8",
                 "--megatron-steps", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_smoke.json").read_text())
    rl, mg = res["rl"], res["megatron"]
    assert rl["device"] == "cpu" and rl["steps"] == 2 and rl["ledger_ok"] and len(rl["curve"]) == 2
    assert rl["tokens_per_s"] > 0 and 0 <= rl["accuracy_after"] <= 1
    assert mg["tensor_parallel_size"] == 1 and mg["tokens_per_s"] > 0 and mg["loss_abs_diff"] < 1e-5
    assert str(tmp_path / "gpu_smoke.json") in capsys.readouterr().out
