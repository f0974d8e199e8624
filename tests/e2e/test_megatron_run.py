"""`trainer.backend: megatron` in a real run: tensor parallel 2 over 2 gloo processes (the run
starts rank 1 itself), the exactly-once ledger and the staleness bound hold, every rank stops."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra; make setup)")

from areal_core.experiment import ConfigError, load_config
from areal_core.run.setup import run_experiment

HERE = Path(__file__).resolve().parents[1]  # tests/
MEGATRON_TP2 = {"kind": "megatron", "tensor_parallel_size": 2, "processes": 2}


@pytest.mark.slow
@pytest.mark.nightly
def test_short_run_with_megatron_tp2_on_two_processes(tmp_path, warm_cache):
    cfg = load_config(HERE / "data/e2e.yaml", {"trainer.backend": MEGATRON_TP2, "trainer.max_steps": 3})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["ledger_check"]["ok"], summary["ledger_check"]
    assert summary["steps"] == 3 and summary["max_staleness_observed"] <= cfg.trainer.eta
    assert summary["trainer_backend"] == "megatron"
    assert (tmp_path / "run/megatron_rank1.log").is_file()
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and "megatron" in " ".join(p.cmdline())
    ]
    assert not left, f"megatron ranks still running: {left}"


def test_megatron_backend_config_errors():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(2\) must divide trainer.backend.processes \(3\)"):
        load_config(HERE / "data/e2e.yaml", {"trainer.backend": {**MEGATRON_TP2, "processes": 3}})
    assert load_config(HERE / "data/e2e.yaml", {"trainer.backend": "megatron"}).trainer.backend.processes == 1
    with pytest.raises(ConfigError, match=r"trainer.backend"):
        load_config(HERE / "data/e2e.yaml", {"trainer.backend": {"kind": "deepspeed"}})
