"""A run across three hosts, for real: Linux network namespaces made by the test on a private
bridge (tests/netns.py), each with its own address.

- trainer host (10.231.0.1): the training run (controller, trainer), the Dask scheduler and the
  S3 endpoint (moto's server) that checkpoints go to;
- two rollout hosts (10.231.0.2, .3): an embedded rollout server and a Dask worker each.

The run reaches them only by those addresses: the servers by URL with an API key, the weights by
the distributed transport (gloo over TCP across the bridge), the rewards by the remote scheduler.
The servers load the run's first version from the S3 endpoint, not from the trainer's disk.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from areal_core.experiment import load_config
from areal_core.models import build_char_tokenizer, build_tiny
from infra.s3 import MotoS3Server, moto_server_executable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from netns import private_hosts, unavailable

HERE = Path(__file__).resolve().parents[1]  # tests/
REPO = HERE.parent
BIN = Path(sys.executable).parent
STEPS, EVERY = 20, 5
KEY_ENV = "AF_TEST_ROLLOUT_KEY"

pytestmark = [pytest.mark.nightly]


def _wait(host, url: str, timeout_s: float = 120.0) -> None:
    """Wait, in ``host``, until ``url`` answers (any HTTP status)."""
    host.python(
        f"""
import time, urllib.request, urllib.error
deadline = time.monotonic() + {timeout_s}
while True:
    try:
        urllib.request.urlopen({url!r}, timeout=2); break
    except urllib.error.HTTPError: break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.3)
""",
        timeout_s=timeout_s + 30,
    )


def _model_info(host, url: str, key: str) -> dict:
    return json.loads(
        host.python(f"""
import urllib.request
r = urllib.request.Request({url!r} + "/model_info", headers={{"Authorization": "Bearer {key}"}})
print(urllib.request.urlopen(r, timeout=30).read().decode())
""")
    )


@pytest.mark.skipif(bool(unavailable()), reason=f"network namespaces: {unavailable()}")
def test_async_run_across_three_hosts(tmp_path):
    base = build_tiny(load_config(HERE / "data/e2e.yaml").model.tiny, tok := build_char_tokenizer(), seed=7)
    base.save_pretrained(tmp_path / "base")  # each rollout host starts from a model of its own disk
    tok.save_pretrained(tmp_path / "base")
    key = "k-" + tmp_path.name
    with private_hosts(["trainer", "r1", "r2"]) as hosts:
        t, remotes = hosts["trainer"], [hosts["r1"], hosts["r2"]]
        moto = MotoS3Server(port=9000, host=t.address)  # (started below, in the trainer host)
        s3 = moto.endpoint_url
        env = {**moto.env(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DASK_LOGGING__DISTRIBUTED": "warning"}
        t.start([moto_server_executable(), "-H", t.address, "-p", "9000"], tmp_path / "moto.log")
        t.start(
            [str(BIN / "dask"), "scheduler", "--host", t.address, "--port", "8786", "--no-dashboard"],
            tmp_path / "scheduler.log",
            env,
        )
        _wait(t, f"{s3}/moto-api/data.json")
        t.python("from areal_core.storage.fsutil import ensure_bucket; ensure_bucket('s3://multihost')", env)
        engine = json.dumps({"max_running": 64, "weight_hashes": True})
        for h in remotes:
            h.start(
                [
                    str(BIN / "dask"),
                    "worker",
                    f"tcp://{t.address}:8786",
                    "--host",
                    h.address,
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--name",
                    h.name,
                    "--preload",
                    "areal_core.data.synthetic",
                    "--preload",
                    "areal_core.reward.math",
                ],
                tmp_path / f"worker-{h.name}.log",
                env,
            )
            h.start(
                [
                    sys.executable,
                    "-m",
                    "areal_core.rollout.backends.embedded.server",
                    "--model-path",
                    str(tmp_path / "base"),
                    "--host",
                    h.address,
                    "--port",
                    "30000",
                    "--engine-config",
                    engine,
                ],
                tmp_path / f"server-{h.name}.log",
                {**env, "AREAL_ROLLOUT_API_KEY": key},
            )
        urls = [f"http://{h.address}:30000" for h in remotes]
        for u in urls:
            _wait(t, u + "/health")

        cfg = yaml.safe_load((HERE / "data/e2e.yaml").read_text())
        cfg["rollout"].update(
            backend={"kind": "external", "urls": urls, "api_key_env": KEY_ENV},
            weight_transport={"kind": "distributed", "master_address": t.address},
        )
        cfg["trainer"]["max_steps"] = STEPS
        cfg["storage"] = {"url": "s3://multihost/run", "checkpoint_every": EVERY}
        cfg["reward"] = {"scheduler_address": f"tcp://{t.address}:8786"}
        (tmp_path / "multihost.yaml").write_text(yaml.safe_dump(cfg))
        run_dir = tmp_path / "run"
        train = subprocess.run(
            t.command(
                [
                    str(BIN / "areal-flow"),
                    "train",
                    str(tmp_path / "multihost.yaml"),
                    "--run-dir",
                    str(run_dir),
                    "--no-prefect",
                    "--no-progress",
                ]
            ),
            env={**os.environ, **env, KEY_ENV: key},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-5000:]

        # every trajectory trained exactly once, none staler than eta
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["ledger_check"]["ok"], summary["ledger_check"]
        ledger = pd.read_parquet(run_dir / "ledger.parquet")
        assert len(ledger) == STEPS * cfg["trainer"]["batch_size"]
        assert (ledger["trained_by_version"] - ledger["min_token_version"]).max() <= cfg["trainer"]["eta"]

        # rewards graded on the rollout hosts' workers, both of them, nowhere else
        graders = {a.split("//")[1].rsplit(":", 1)[0] for a in ledger["graded_by"]}
        assert graders == {h.address for h in remotes}, ledger["graded_by"].value_counts()

        # both servers went live with the same bytes at every version, and with the trainer's own
        # at each checkpoint (its weights_sha256): the weights crossed hosts intact
        hashes = [{int(v): s for v, s in _model_info(t, u, key)["weight_hashes"].items()} for u in urls]
        assert hashes[0] == hashes[1]
        assert set(range(STEPS + 1)) <= set(hashes[0]), sorted(hashes[0])
        metrics = pd.read_parquet(run_dir / "metrics.parquet")
        at_checkpoints = metrics.dropna(subset=["weights_sha256"])
        assert list(at_checkpoints["step"]) == list(range(EVERY, STEPS + 1, EVERY))
        for step, sha in zip(at_checkpoints["step"], at_checkpoints["weights_sha256"]):
            assert hashes[0][int(step)] == sha, step

        # the checkpoints are on the S3 endpoint, complete, and v0 is what the servers started with
        versions = t.python(
            "from areal_core.storage import CheckpointStore; print(CheckpointStore('s3://multihost/run').versions())",
            env,
        )
        assert versions.strip() == str([0, *range(EVERY, STEPS + 1, EVERY)])
        for h in remotes:
            assert "s3://multihost/run/v0" in (tmp_path / f"server-{h.name}.log").read_text()
