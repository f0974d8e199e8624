"""Preemption on Slurm: the quickstart trained while the scheduler preempts its rollout servers' jobs.

The Slurm form of ``bench/preemption.py``. A real Slurm (``tests/slurm_cluster.py``: munged, slurmctld
and three slurmd nodes, each in a network namespace of its own; root and ``make slurm`` needed) with
two partitions: ``cpu``, where the run's jobs go, and ``urgent``, whose jobs preempt those of ``cpu``
(``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``). The run is started as a user
starts it, ``areal-flow train CONFIG --cluster slurm`` on the login node: the trainer's job on n1, the
two rollout servers' job array on n2 (2 CPUs each: together they fill the node), the reward workers
on n3. Every ``--every`` steps a 2-CPU job of ``urgent`` that holds n2 for ``HOLD_S`` seconds is
submitted: Slurm itself preempts one server's job to make room, requeues it and starts it again once
the urgent job ends; the server then rejoins the pool. Nothing here signals a process.

Against an undisturbed run on the same cluster, per seed: trajectories lost (admitted answers of a
group trained only in part, steps short of a batch) and trained twice, the largest staleness against
eta, held-out accuracy, the effective training throughput, the preemptions Slurm made (its tasks'
``Restarts``), and two start-up times: ``provision`` (the reward workers brought up as jobs, a known
answer graded, the jobs cancelled) and the trainer job's submission to its first trained step (each
seed's warm start cached by a 1-step run first, which is not counted).

--quick: one seed, 60 steps, an urgent job every 20: a smoke check; no figure to quote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import REPO_ROOT, format_table
from bench.learning import mean_std, runs_root, say
from bench.preemption import pool_summary, run_row

sys.path.insert(0, str(REPO_ROOT / "tests"))
from slurm_cluster import URGENT, slurm_cluster, unavailable  # (the tests' Slurm cluster)

CONFIG = REPO_ROOT / "configs/quickstart.yaml"
AREAL_FLOW = str(REPO_ROOT / ".venv/bin/areal-flow")
HOLD_S = 10  # how long an urgent job holds the servers' node


def _config(cluster, name: str, seed: int, steps: int) -> str:
    cfg = {
        "extends": str(CONFIG),
        "name": name,
        "seed": seed,
        "rollout": {"n_servers": 2},
        "trainer": {"max_steps": steps},
        "cluster": {
            "kind": "slurm",
            "partition": "cpu",
            "start_timeout_s": 600,
            "trainer": {"extra_sbatch": ["--nodelist=n1"]},
            "rollout": {"cpus_per_task": 2, "extra_sbatch": ["--nodelist=n2"]},
            "reward": {"extra_sbatch": ["--nodelist=n3"]},
        },
    }
    path = cluster.shared / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _steps_done(run_dir: Path) -> int:
    return len(list((run_dir / "schedule").glob("step-*.parquet"))) if (run_dir / "schedule").is_dir() else 0


class PoolWatch:
    """Whether both servers have been listed (``RUN/slurm/rollout-servers.txt``) and answering for
    ``SETTLE_S``: a server the scheduler requeued is back and the run has had time to take it in (it
    looks every 2 s, then sends the current weights), so the next urgent job does not find the pool
    still short. Health is asked from the login node (the servers' network is the cluster's)."""

    SETTLE_S = 15.0

    def __init__(self, cluster, run_dir: Path):
        self.cluster, self.path = cluster, run_dir / "slurm/rollout-servers.txt"
        self.listed, self.since = frozenset(), time.monotonic()

    def _answers(self, url: str) -> bool:
        out = self.cluster.run(
            ["curl", "-s", "-m", "2", "-o", "/dev/null", "-w", "%{http_code}", url + "/health"], check=False
        )
        return out.strip() == "200"

    def settled(self) -> bool:
        listed = frozenset(self.path.read_text().split()) if self.path.is_file() else frozenset()
        listed = frozenset(u for u in listed if self._answers(u))
        if listed != self.listed:
            self.listed, self.since = listed, time.monotonic()
        return len(listed) == 2 and time.monotonic() - self.since >= self.SETTLE_S


def _restarts(cluster, run_dir: Path) -> int:
    """How many times Slurm requeued the run's rollout tasks."""
    ids = [j["job_id"] for j in json.loads((run_dir / "slurm/jobs.json").read_text()) if j["role"] == "rollout"]
    text = "".join(cluster.run(["scontrol", "-o", "show", "job", i], check=False) for i in ids)
    return sum(int(f.split("=", 1)[1]) for f in text.split() if f.startswith("Restarts="))


def one_run(cluster, label: str, seed: int, steps: int, every: int | None, env: dict) -> dict:
    run_dir = cluster.shared / label
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [AREAL_FLOW, "train", _config(cluster, label, seed, steps), "--run-dir", str(run_dir)]
    cmd += ["--cluster", "slurm", "--no-progress"]
    say(f"{label}: {' '.join(cmd[1:])}")
    events: list[dict] = []
    t0 = time.perf_counter()
    with open(cluster.root / f"{label}.log", "wb") as log:
        proc = subprocess.Popen(cluster.command(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            next_at, pool = every, PoolWatch(cluster, run_dir)
            while proc.poll() is None:
                time.sleep(0.5)
                if next_at is None or next_at >= steps or _steps_done(run_dir) < next_at or not pool.settled():
                    continue  # (an urgent job waits until the last preempted server is back in the pool)
                urgent = ["sbatch", "--parsable", "-p", URGENT, "-w", "n2", "-c", "2", "-J", "urgent"]
                urgent += ["-o", str(cluster.root / "log/urgent-%j.out"), "--wrap", f"sleep {HOLD_S}"]
                job = cluster.run(urgent).strip()
                events.append({"step": _steps_done(run_dir), "urgent_job": job, "t": time.perf_counter() - t0})
                next_at += every
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{label} exited with {rc}; see {cluster.root / (label + '.log')}")
    row = run_row(label, seed, every, run_dir, wall, events)
    submitted = json.loads((run_dir / "slurm/jobs.json").read_text())[0]["submitted"]
    row["submission_to_first_step_s"] = (run_dir / "schedule/step-000001.parquet").stat().st_mtime - submitted
    row["slurm_requeues"] = _restarts(cluster, run_dir)
    return row


PROVISION = """
import json, time
from areal_core.experiment import load_config
from areal_core.ops.provision import provision
t0 = time.perf_counter()
report = provision(load_config({config!r}), {out!r})
report["wall_s"] = time.perf_counter() - t0
print(json.dumps(report))
"""


def _provision(cluster, env: dict) -> dict:
    config = _config(cluster, "provision", 0, 1)
    code = PROVISION.format(config=config, out=str(cluster.shared / "provision"))
    out = subprocess.run(cluster.command([sys.executable, "-c", code]), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"provision failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict:
    why = unavailable()
    if why:
        raise RuntimeError(f"a Slurm cluster cannot start here: {why}")
    root = runs_root("preemption_slurm" + ("_quick" if quick else ""))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    seeds, steps, every = ((0,), 60, 20) if quick else ((0, 1), 300, 40)
    with slurm_cluster(root / "cluster", preemption=True) as cluster:
        env = {**os.environ, **cluster.env, "AREAL_FLOW_CACHE": str(cluster.shared / "cache")}
        provision = _provision(cluster, env)
        say(f"provision: reward workers as Slurm jobs, checked and cancelled in {provision['wall_s']:.1f} s")
        rows = []
        for seed in seeds:  # per seed: undisturbed, then preempted (one after the other: each has the machine)
            one_run(cluster, f"warm-s{seed}", seed, 1, None, env)  # the seed's warm start, cached, not counted
            rows.append(one_run(cluster, f"steady-s{seed}", seed, steps, None, env))
            rows.append(one_run(cluster, f"preempted-s{seed}", seed, steps, every, env))
    steady = [r for r in rows if r["kill_every"] is None]
    hit = [r for r in rows if r["kill_every"] is not None]
    table = [
        (
            f"urgent job every {every} steps" if r["kill_every"] else "undisturbed",
            r["seed"],
            r["after"],
            r["trajectories_lost"],
            r["trajectories_duplicated"],
            f"{r['max_staleness']} / {r['eta']}",
            r["tokens_per_s"],
            r["slurm_requeues"],
            f"{len(r['pool']['left'])} / {len(r['pool']['joined'])}",
            r["submission_to_first_step_s"],
        )
        for r in rows
    ]
    print(
        format_table(
            ["pool", "seed", "held-out after", "lost", "trained twice", "staleness / eta", "train tok/s"]
            + ["Slurm requeues", "left / joined", "submit -> step 1 (s)"],
            table,
            title=f"quickstart on Slurm, {steps} steps, 2 servers preempted by the scheduler",
        )
    )
    summary = {
        **pool_summary(steady, hit),
        "urgent_jobs": sum(len(r["events"]) for r in hit),
        "slurm_requeues": sum(r["slurm_requeues"] for r in hit),
        "provision_s": provision["wall_s"],
        "submission_to_first_step_s": mean_std([r["submission_to_first_step_s"] for r in rows]),
    }
    ratios = summary["throughput_preempted_over_undisturbed"]
    print(f"preempted / undisturbed training throughput per seed: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"provision (reward workers as jobs, checked, cancelled): {provision['wall_s']:.1f} s")
    return {"rows": rows, "provision": provision, "summary": summary}
