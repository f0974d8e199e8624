"""rollout.dtype: rollout servers computing in bfloat16 beside a float32 trainer, a whole run.

The engine-vs-trainer logprob gap at the behaviour version (logprob_gap_*) is the numerics
mismatch alone: about 1e-7 nats when both compute in float32, orders of magnitude more with
bfloat16 servers; the weights travel rounded, at half the bytes."""

from pathlib import Path

import pandas as pd
import pytest

from areal_core.experiment import load_config
from areal_core.run.setup import run_experiment

HERE = Path(__file__).resolve().parents[1]  # tests/
SYNC = {"trainer.eta": 0, "rollout.weight_update": "drain", "trainer.max_steps": 2}


@pytest.mark.nightly
def test_bfloat16_servers_beside_a_float32_trainer(tmp_path, warm_cache):
    runs = {}
    for dtype in ("model", "bfloat16"):
        cfg = load_config(HERE / "data/e2e.yaml", {**SYNC, "rollout.dtype": dtype})
        summary = run_experiment(cfg, tmp_path / dtype, progress=False, cache_dir=warm_cache)
        runs[dtype] = (summary, pd.read_parquet(tmp_path / dtype / "metrics.parquet"))
    (same, m_same), (bf16, m_bf16) = runs["model"], runs["bfloat16"]
    assert (same["dtype"], same["rollout_dtype"]) == ("float32", "float32")
    assert (bf16["dtype"], bf16["rollout_dtype"]) == ("float32", "bfloat16")
    for s in (same, bf16):
        assert s["ledger_check"]["ok"] and s["steps"] == 2
    # synchronous: every trained token was sampled at the trainer's version, so the gap covers them all
    assert (m_bf16["logprob_gap_tokens_sum"] == m_bf16["tokens_trained"]).all()
    assert m_same["logprob_gap_mean"].max() < 1e-5
    assert m_bf16["logprob_gap_mean"].min() > 100 * m_same["logprob_gap_mean"].max()
    assert m_bf16["logprob_gap_max"].max() > m_bf16["logprob_gap_mean"].max()
    assert (m_bf16["weight_update_bytes"] * 2 == m_same["weight_update_bytes"]).all()
