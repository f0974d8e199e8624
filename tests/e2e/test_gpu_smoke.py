"""infra/gpu_smoke, the GPU smoke run, here on the CPU with the tiny model: every part completes with its
figures and its checks, a failing part is recorded and the next still runs, a part that cannot run is
skipped with its reason, and gpu_smoke.json is complete after every part (a killed run keeps them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from infra.gpu_smoke import cli
from infra.gpu_smoke.cli import main

HERE = Path(__file__).resolve().parents[1]  # tests/
TINY = [
    "--model",
    "tiny",
    "--config",
    str(HERE / "data/e2e.yaml"),
    "--device",
    "cpu",
    "--batches",
    "4,8",
    "--new-tokens",
    "8",
    "--reps",
    "1",
    "--train-batch",
    "8",
    "--seq-len",
    "48",
    "--train-steps",
    "1",
    "--check-batch",
    "8",
    "--check-len",
    "32",
    "--megatron-steps",
    "1",
    "--steps",
    "2",
    "--eval-problems",
    "8",
]


def _read(out: Path) -> dict:
    return json.loads((out / "gpu_smoke.json").read_text())


@pytest.mark.slow
@pytest.mark.nightly  # (each part is also a test of its own in make test; this is the script's whole run)
def test_every_part_runs_on_the_cpu(tmp_path, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra; make setup)")
    prefect_before = "prefect" in sys.modules  # (another test in this worker may have imported it)
    assert main(TINY + ["--out", str(tmp_path)]) == 0
    res = _read(tmp_path)
    parts = res["parts"]
    assert res["finished"] and res["prefect_imported"] is (None if prefect_before else False)
    assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(
        ["env", "model", "engine", "trainer", "rl", "megatron"], "ok"
    )
    assert parts["env"]["torch"] and parts["env"]["cuda_available"] is False
    eng = parts["engine"]
    assert [r["batch"] for r in eng["rows"]] == [4, 8] and all(r["engine_tokens_per_s"] > 0 for r in eng["rows"])
    assert eng["logprobs"]["tokens"] == 8 * 8 and eng["logprobs_float32"]["max_abs"] <= 1e-3 and eng["ok"]
    tr = parts["trainer"]
    assert tr["tokens_per_step"] == 8 * 48 and tr["tokens_per_s"] > 0
    eq = tr["equality"]
    assert eq["ok"] and eq["loss_rel_diff"] <= eq["tolerance"] == 1e-4 and eq["nll_rel_diff"] <= 1e-4
    assert eq["loss"] < -1e-3 and eq["mean_nll"] > 0  # -5 x mean exp(logp + 3): never near 0
    rl = parts["rl"]
    assert rl["steps"] == 2 and rl["ledger_ok"] and rl["staleness_ok"] and rl["ok"]
    assert rl["transport"] == {"kind": "distributed", "backend": "gloo"} and rl["nccl_same_gpu_probe"] is None
    assert "weight_push_s" in rl["weight_columns"] and rl["server_update_s"]["n"] >= 1
    assert len(rl["curve"]) == 2 and (tmp_path / "rl/metrics.parquet").exists()
    mg = parts["megatron"]
    assert mg["tensor_parallel_size"] == 1 and mg["equality"]["loss_rel_diff"] < 1e-5 and mg["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "gpu_smoke.json") in printed and "megatron  ok" in printed


def test_a_failing_part_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    """The engine part raises: its error is in the JSON, the trainer part still runs, the exit code is 1;
    and when a part starts, the earlier parts are already on disk."""
    seen = {}

    def broken(setup):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def looks(setup):
        seen.update(_read(tmp_path)["parts"])  # what a kill at this moment would leave
        return {"figure": 1.5}

    import infra.gpu_smoke.engine_part as ep
    import infra.gpu_smoke.trainer_part as tp

    monkeypatch.setattr(ep, "engine_part", broken)
    monkeypatch.setattr(tp, "trainer_part", looks)
    assert main(TINY + ["--out", str(tmp_path), "--parts", "engine,trainer"]) == 1
    parts = _read(tmp_path)["parts"]
    assert parts["engine"]["status"] == "failed"
    assert "illegal memory access" in parts["engine"]["error"] and "broken" in parts["engine"]["traceback"]
    assert parts["trainer"] == {"status": "ok", "figure": 1.5, "seconds": parts["trainer"]["seconds"]}
    assert seen["model"]["status"] == "ok" and seen["engine"]["status"] == "failed"
    assert seen["trainer"] == {"status": "running"}


def test_parts_that_cannot_run_say_why(tmp_path, monkeypatch):
    """NCCL asked for without a GPU, megatron-core missing, and parts after a model that did not load."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron" else real(name, *a))
    assert main(TINY + ["--out", str(tmp_path), "--parts", "rl,megatron", "--rl-transport", "nccl"]) == 0
    parts = _read(tmp_path)["parts"]
    assert parts["rl"]["status"] == "skipped" and "needs the engine and the trainer on a GPU" in parts["rl"]["reason"]
    assert parts["megatron"]["status"] == "skipped" and "megatron-core is not installed" in parts["megatron"]["reason"]

    out2 = tmp_path / "no-model"
    assert (
        main(TINY[:1] + [str(tmp_path / "missing-model")] + TINY[2:] + ["--out", str(out2), "--parts", "engine"]) == 1
    )
    parts = _read(out2)["parts"]
    assert parts["model"]["status"] == "failed"
    assert parts["engine"]["status"] == "skipped" and parts["engine"]["reason"].startswith("the model did not load")


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        cli.parse_args(["--parts", "env,warp"])


def test_the_table_reads_every_status(tmp_path, capsys):
    from infra.gpu_smoke.common import Results

    res = Results(tmp_path / "r.json")
    res.start({})
    res.run(
        "env",
        lambda: {
            "gpu": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0",
            "torch_cuda": "13.0",
            "bf16_supported": True,
            "matmul_bf16_tflops": 790.0,
        },
    )
    res.run("rl", lambda: (_ for _ in ()).throw(ValueError("no port")))
    res.data["prefect_imported"] = False
    res.finish()
    cli.print_table(res)
    printed = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3, torch 2.11.0 (CUDA 13.0), bf16 True" in printed
    assert "rl        failed" in printed and "ValueError: no port" in printed
