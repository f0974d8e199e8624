"""A real short run with the retry-with-feedback episode: embedded servers, Dask grading, the
trainer; wrong answers got feedback (environment tokens, never trained) and another turn, and the
exactly-once ledger still holds."""

import pandas as pd
import pytest

from areal_core.experiment import load_config
from areal_core.run.setup import run_experiment


@pytest.mark.slow
def test_retry_episode_runs_end_to_end(tmp_path, warm_cache, shared_rewards):
    cfg = load_config(
        "tests/data/e2e.yaml",
        {
            "episode": {"kind": "retry", "max_turns": 2, "discount": 0.5},
            "trainer.max_steps": 3,
            "rollout.sampling.max_new_tokens": 24,
            **shared_rewards,
        },
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["steps"] == 3 and summary["ledger_check"]["ok"], summary["ledger_check"]
    m = pd.read_parquet(tmp_path / "run/metrics.parquet")
    # the tiny model is often wrong: some answers took a second turn, after masked feedback text
    assert (m["turns_mean"] > 1).any() and (m["environment_tokens"] > 0).any()
    assert (m["turns_mean"] <= 2).all()
