"""Whole runs on a real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld and three slurmd nodes,
each in a network namespace of its own, the run's folder on the folder they share), started as a user
would, from the login node: ``areal-flow train CONFIG --cluster slurm``. The trainer is a job on n1,
the rollout servers a job array on n2, the reward workers a dask-jobqueue job on n3.

- the quickstart config trains 40 steps (its supervised warm start cut to 60 steps: it is the
  trainer job's first 10 minutes otherwise, and the pools are what is tested): the ledger exactly
  once, no token staler than eta, every answer graded on n3, each job on its node, none left in
  ``squeue`` after; the time from submission to the first trained step is printed;
- one rollout server's job is cancelled with ``scancel`` mid-run and then requeued: it leaves the
  pool, comes back (a new URL) and joins again; the run, stopped once it has and resumed, loses
  nothing and trains nothing twice;
- the trainer's job is requeued mid-run (what a preemption does): the requeued job resumes the run
  from its last checkpoint with new pools, and the run ends once, followed throughout;
- the run is cancelled (SIGTERM to ``areal-flow train``, as a Prefect cancellation does): no job of
  the run is left in ``squeue``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import slurm_cluster, unavailable

HERE = Path(__file__).resolve().parents[1]  # tests/
REPO = HERE.parent
AREAL_FLOW = str(Path(sys.executable).parent / "areal-flow")
STEPS = 40

# the runs' own deadlines (a requeued job waited for, a run followed to its end) are up to 30-40 min on
# a slow, shared machine: pytest's general 10 min would cut them before they can say what went wrong
pytestmark = [
    pytest.mark.nightly,
    pytest.mark.timeout(2700),
    pytest.mark.skipif(bool(unavailable()), reason=f"Slurm: {unavailable()}"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _config(
    cluster,
    name: str,
    steps: int,
    base: Path = HERE / "data/e2e.yaml",
    trainer: dict | None = None,
    trainer_job=None,
    model: dict | None = None,
) -> str:
    """``base`` (the tests' small config, or the quickstart) with two rollout servers and each pool a
    Slurm job on a node of its own: the trainer on n1 (or ``trainer_job``'s nodes), the servers on n2,
    the reward workers on n3; ``trainer``, ``model``: more of those settings."""
    cfg = {
        "extends": str(base),
        "name": name,
        **({"model": model} if model else {}),
        "rollout": {"n_servers": 2},
        "trainer": {"max_steps": steps, **(trainer or {})},
        "cluster": {
            "kind": "slurm",
            "partition": "cpu",
            "time_limit": "1:00:00",
            "start_timeout_s": 300,
            "trainer": trainer_job or {"extra_sbatch": ["--nodelist=n1"]},
            "rollout": {"extra_sbatch": ["--nodelist=n2"]},
            "reward": {"extra_sbatch": ["--nodelist=n3"]},
        },
    }
    path = cluster.shared / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _loaded(config: str) -> dict:
    """The config as the run reads it (``extends`` resolved)."""
    from areal_core.experiment import load_config

    return load_config(config).model_dump()


def _train(cluster, config: str, run: Path) -> list[str]:
    return cluster.command([AREAL_FLOW, "train", config, "--run-dir", str(run), "--cluster", "slurm", "--no-progress"])


def _env(cluster) -> dict[str, str]:
    return {**os.environ, **cluster.env, "AREAL_FLOW_CACHE": str(cluster.shared / "cache")}


def _jobs(run: Path) -> dict[str, list[str]]:
    by_role: dict[str, list[str]] = {}
    for j in json.loads((run / "slurm/jobs.json").read_text()):
        by_role.setdefault(j["role"], []).append(j["job_id"])
    return by_role


def _nodes(cluster, job_id: str) -> set[str]:
    out = cluster.run(["scontrol", "-o", "show", "job", job_id])
    return {f.split("=", 1)[1] for line in out.splitlines() for f in line.split() if f.startswith("NodeList=")}


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s:.0f} s"
        time.sleep(1.0)


def _check_ledger(run: Path, steps: int, batch: int, eta: int) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ledger_check"]["ok"], summary["ledger_check"]
    ledger = pd.read_parquet(run / "ledger.parquet")
    assert len(ledger) == steps * batch and ledger["trajectory_id"].is_unique
    assert (ledger["trained_by_version"] - ledger["min_token_version"]).max() <= eta
    return summary


def test_the_quickstart_trains_with_its_trainer_servers_and_workers_slurm_jobs(cluster):
    run = cluster.shared / "run-e2e"
    short_warm_start = {"warm_start": {"steps": 60, "check_every": 20}}
    config = _config(cluster, "slurm-e2e", STEPS, REPO / "configs/quickstart.yaml", model=short_warm_start)
    proc = subprocess.run(_train(cluster, config, run), env=_env(cluster), capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "trainer: job" in proc.stdout and "RUNNING on n1" in proc.stdout  # followed from the login node

    cfg = _loaded(config)
    _check_ledger(run, STEPS, cfg["trainer"]["batch_size"], cfg["trainer"]["eta"])
    jobs = _jobs(run)
    assert sorted(jobs) == ["reward", "rollout", "trainer"] and len(jobs["trainer"]) == 1
    assert _nodes(cluster, jobs["trainer"][0]) == {"n1"}
    assert _nodes(cluster, jobs["rollout"][0]) == {"n2"}
    assert {n for j in jobs["reward"] for n in _nodes(cluster, j)} == {"n3"}
    graders = {a.split("//")[1].rsplit(":", 1)[0] for a in pd.read_parquet(run / "ledger.parquet")["graded_by"]}
    assert graders == {cluster.nodes["n3"].address}
    assert cluster.queue() == []

    submitted = json.loads((run / "slurm/jobs.json").read_text())[0]["submitted"]
    first_step = (run / "schedule/step-000001.parquet").stat().st_mtime
    print(f"\nSlurm: submission of the trainer's job to its first trained step: {first_step - submitted:.1f} s")


def test_a_megatron_trainer_runs_its_ranks_as_tasks_on_two_nodes(cluster):
    """``trainer.backend: megatron`` over 2 processes (tensor parallel 2) with ``cluster.trainer.nodes: 2``:
    the trainer's job runs one rank per node through srun, the two ranks meet over gloo across the
    nodes' networks. Ctrl-C on the login node stops the run at a checkpoint (rank 0 saves it with
    rank 1's help, then releases it), ``--resume`` continues it, and the run holds its guarantees."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra; make setup)")
    run = cluster.shared / "run-megatron"
    steps = 30
    backend = {"backend": {"kind": "megatron", "tensor_parallel_size": 2, "processes": 2}}
    job = {"nodes": 2, "extra_sbatch": ["--nodelist=n1,n2"]}
    config = _config(cluster, "slurm-megatron", steps, trainer=backend, trainer_job=job)
    with open(cluster.root / "megatron-run.log", "w") as out:
        proc = subprocess.Popen(_train(cluster, config, run), env=_env(cluster), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(run / "schedule/step-000003.parquet", proc, 900)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, (cluster.root / "megatron-run.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    first = (cluster.root / "megatron-run.log").read_text()
    assert "stopped; continue with" in first and "--resume" in first, first[-3000:]
    assert cluster.queue() == []
    trainer = _jobs(run)["trainer"][0]
    assert _nodes(cluster, trainer) == {"n[1-2]"}
    script = (run / "slurm/trainer.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script and "exec srun" in script
    log = (run / f"slurm/trainer-{trainer}.log").read_text()
    n1, n2 = cluster.nodes["n1"].address, cluster.nodes["n2"].address
    assert f"megatron rank 1 of 2 (tensor-parallel rank 1 of 2) on {n2}, following rank 0 at {n1}" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]  # rank 1 let rank 0 stop at its checkpoint (nor one at exit)

    again = subprocess.run(
        [*_train(cluster, config, run), "--resume"], env=_env(cluster), capture_output=True, text=True, timeout=2400
    )
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "resuming from checkpoint v" in again.stdout
    cfg = _loaded(config)
    summary = _check_ledger(run, steps, cfg["trainer"]["batch_size"], cfg["trainer"]["eta"])
    assert summary["trainer_backend"] == "megatron"
    assert cluster.queue() == []


def test_a_rollout_job_cancelled_and_requeued_leaves_and_rejoins_the_pool(cluster):
    """The run is set far longer than the test needs, so it is still training whenever the requeued
    server comes back (how long Slurm takes to start it again varies with the machine and its load):
    once the server has joined, Ctrl-C stops the run at a checkpoint, and ``--resume`` finishes it a
    few steps later; the ledger then covers the whole run, the leave and the join included."""
    run = cluster.shared / "run-requeue"
    config = _config(cluster, "slurm-requeue", 5000)
    log = cluster.root / "requeue-run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_train(cluster, config, run), env=_env(cluster), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(run / "schedule/step-000004.parquet", proc, 900)
        task = f"{_jobs(run)['rollout'][0]}_1"
        listed = run / "slurm/rollout-servers.txt"  # where the servers announce themselves
        before = set(listed.read_text().split())
        cluster.run(["scancel", task])
        deadline = time.monotonic() + 60
        while task in cluster.queue():
            assert time.monotonic() < deadline, f"{task} still listed after scancel"
            time.sleep(0.5)
        cluster.run(["scontrol", "requeue", task])
        deadline = time.monotonic() + 300
        while not (new := set(listed.read_text().split()) - before):  # the requeued task, on a new port
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, f"{task} did not serve again within 300 s"
            time.sleep(0.5)
        (url,) = new
        deadline = time.monotonic() + 120
        while f"rollout server {url} joined (2 in the pool)" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, f"{url} did not join within 120 s: " + log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, log.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    first = log.read_text()
    gone = [line for line in first.splitlines() if "is gone; it left the pool" in line]
    assert len(gone) == 1 and f"http://{cluster.nodes['n2'].address}:" in gone[0], first[-3000:]
    assert url.startswith(f"http://{cluster.nodes['n2'].address}:") and url not in gone[0]
    stopped = int(re.findall(r"stopped at step (\d+)", first)[-1])
    assert cluster.queue() == []

    steps = stopped + 3
    again = subprocess.run(
        [*_train(cluster, config, run), "--resume", "--max-steps", str(steps)],
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert f"resuming from checkpoint v{stopped}" in again.stdout, again.stdout[-3000:]
    cfg = _loaded(config)
    _check_ledger(run, steps, cfg["trainer"]["batch_size"], cfg["trainer"]["eta"])  # nothing lost or trained twice
    assert cluster.queue() == []


def test_a_trainer_job_requeued_mid_run_resumes_from_its_last_checkpoint(cluster):
    """What a preemption does to the trainer's job: Slurm stops it (SIGTERM) and runs it again. The
    requeued job continues the run from its last checkpoint with new pools; the run finishes once,
    followed from the login node throughout."""
    run = cluster.shared / "run-trainer-requeue"
    steps = 120
    config = _config(cluster, "slurm-trainer-requeue", steps)
    with open(cluster.root / "trainer-requeue-run.log", "w") as out:
        proc = subprocess.Popen(_train(cluster, config, run), env=_env(cluster), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(run / "schedule/step-000020.parquet", proc, 900)
        trainer = _jobs(run)["trainer"][0]
        cluster.run(["scontrol", "requeue", trainer])
        assert proc.wait(timeout=1800) == 0, (cluster.root / "trainer-requeue-run.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    followed = (cluster.root / "trainer-requeue-run.log").read_text()
    resumed = [line for line in followed.splitlines() if line.startswith("resuming from checkpoint v")]
    assert len(resumed) == 1 and int(resumed[0].split("checkpoint v")[1].split()[0]) >= 18, followed[-3000:]
    out = cluster.run(["scontrol", "-o", "show", "job", trainer])
    assert "Restarts=1" in out and "JobState=COMPLETED" in out, out
    cfg = _loaded(config)
    _check_ledger(run, steps, cfg["trainer"]["batch_size"], cfg["trainer"]["eta"])
    jobs = _jobs(run)  # the first trainer's pools were cancelled, the requeued one submitted its own
    assert len(jobs["trainer"]) == 1 and len(jobs["rollout"]) == 2 and len(jobs["reward"]) == 2, jobs
    assert cluster.queue() == []


def test_cancelling_the_run_leaves_no_job_in_squeue(cluster):
    run = cluster.shared / "run-cancel"
    config = _config(cluster, "slurm-cancel", 400)
    with open(cluster.root / "cancel-run.log", "w") as out:
        proc = subprocess.Popen(_train(cluster, config, run), env=_env(cluster), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(run / "schedule/step-000001.parquet", proc, 900)
        jobs, queue = _jobs(run), cluster.queue()  # the trainer, the servers and the workers are up
        assert jobs["trainer"][0] in queue and set(jobs["reward"]) <= set(queue)
        assert any(q.startswith(jobs["rollout"][0] + "_") for q in queue), queue
        proc.send_signal(signal.SIGTERM)  # what a Prefect cancellation sends the flow run's process
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while cluster.queue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.queue() == [], cluster.queue()
    log = (cluster.root / "cancel-run.log").read_text()
    assert "cancelled the run's Slurm job(s)" in log, log[-3000:]
