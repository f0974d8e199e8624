"""Elastic rollout pools, for real: servers this run did not start (rollout.backend external, the
distributed weight transport), one killed with SIGKILL in the middle of generating, one joining
the running run through rollout.join_from; and rollout.min_servers stopping a run at a checkpoint
that resumes on other servers."""

import json
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from areal_core.controller.elastic import announce
from areal_core.experiment import load_config
from areal_core.models import build_char_tokenizer, build_tiny
from areal_core.rollout.backends.embedded.launcher import start_server
from areal_core.run.setup import RunStopped, run_experiment
from areal_core.storage import CheckpointStore

HERE = Path(__file__).resolve().parents[1]  # tests/
KEY_ENV = "AF_TEST_ELASTIC_KEY"
KEY = "elastic-test-key"

pytestmark = pytest.mark.nightly  # (two runs with servers killed; CI runs the nightly tests after make test)


@pytest.fixture
def base(tmp_path) -> str:
    """A model folder of the run's architecture: what the servers start from (the run loads its own)."""
    folder = tmp_path / "base"
    build_tiny(load_config(HERE / "data/e2e.yaml").model.tiny, tok := build_char_tokenizer(), seed=3).save_pretrained(
        folder
    )
    tok.save_pretrained(folder)
    return str(folder)


def _server(base: str, tmp_path: Path, name: str):
    return start_server(base, api_key=KEY, log_path=str(tmp_path / f"{name}.log"), max_running=64, weight_hashes=True)


def _info(url: str) -> dict:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def _config(urls: list[str], tmp_path: Path, steps: int, **rollout):
    return load_config(
        HERE / "data/e2e.yaml",
        {
            "rollout.backend": {"kind": "external", "urls": urls, "api_key_env": KEY_ENV},
            "rollout.weight_transport": {"kind": "distributed"},
            "trainer.max_steps": steps,
            "storage.checkpoint_every": 4,
            **{f"rollout.{k}": v for k, v in rollout.items()},
        },
    )


def test_a_server_dies_and_another_joins(tmp_path, base, monkeypatch, warm_cache):
    monkeypatch.setenv(KEY_ENV, KEY)
    a, b, c = (_server(base, tmp_path, name) for name in "abc")  # c: up, not yet part of the run
    join_file = str(tmp_path / "join.txt")
    cfg = _config([a.url, b.url], tmp_path, 12, min_servers=1, join_from=join_file)

    def on_step(row: dict) -> None:
        if row["step"] == 3:  # a dies mid-generation (the queue holds eta + 1 batches); c is announced
            a._signal(9)
            announce(join_file, [c.url])
        if row["step"] == 5:  # (training goes on meanwhile; here the run waits for c to hold weights)
            deadline = time.monotonic() + 60
            while _info(c.url)["weight_version"] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)

    try:
        summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache, on_step=on_step)
        assert summary["rollout_pool"]["left"] == [a.url]
        assert summary["rollout_pool"]["joined"] == [c.url]

        # nothing lost or trained twice, none staler than eta
        assert summary["ledger_check"]["ok"], summary["ledger_check"]
        ledger = pd.read_parquet(tmp_path / "run/ledger.parquet")
        assert len(ledger) == 12 * cfg.trainer.batch_size
        assert (ledger["trained_by_version"] - ledger["min_token_version"]).max() <= cfg.trainer.eta

        # c generated, and it and b hold the trainer's final weights, byte for byte
        metrics = pd.read_parquet(tmp_path / "run/metrics.parquet")
        final = metrics.dropna(subset=["weights_sha256"]).iloc[-1]
        infos = [_info(b.url), _info(c.url)]
        assert infos[1]["generated_tokens"] > 0
        # from its own start folder (0) straight to the version current when it joined (after a died at 3)
        versions = sorted(int(v) for v in infos[1]["weight_hashes"])
        assert versions[0] == 0 and versions[1] >= 3, versions
        for info in infos:
            assert info["weight_hashes"][str(int(final["step"]))] == final["weights_sha256"]
    finally:
        for s in (a, b, c):
            s.stop()


def test_too_few_servers_stop_the_run_at_a_checkpoint_that_resumes(tmp_path, base, monkeypatch, warm_cache):
    monkeypatch.setenv(KEY_ENV, KEY)
    a = _server(base, tmp_path, "a")
    servers = [a]
    try:
        cfg = _config([a.url], tmp_path, 8, min_servers=1)

        def on_step(row: dict) -> None:
            if row["step"] == 2:
                a._signal(9)

        with pytest.raises(RunStopped, match=r"0 rollout server\(s\) left, rollout.min_servers is 1") as stopped:
            run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache, on_step=on_step)
        step = stopped.value.step
        assert step >= 2
        assert step in CheckpointStore(str(tmp_path / "run/checkpoints")).versions()

        b = _server(base, tmp_path, "b")
        servers.append(b)
        summary = run_experiment(
            _config([b.url], tmp_path, 8, min_servers=1),
            tmp_path / "run",
            progress=False,
            cache_dir=warm_cache,
            resume=True,
        )
        assert summary["resumed_from_step"] == step
        assert summary["ledger_check"]["ok"], summary["ledger_check"]
        assert len(pd.read_parquet(tmp_path / "run/ledger.parquet")) == 8 * cfg.trainer.batch_size
    finally:
        for s in servers:
            s.stop()
