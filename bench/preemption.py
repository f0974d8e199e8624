"""Preemptible rollout pools: the quickstart trained while its servers are killed and replaced.

Two embedded rollout servers started here, given to the run as servers it did not start
(``rollout.backend: external``, the distributed weight transport, ``rollout.min_servers: 1``,
``rollout.join_from``). Every ``KILL_EVERY`` steps one of them is killed with SIGKILL, without
notice, and a new one is started and announced 10 s later. Against undisturbed runs on the same
kind of pool, per seed: trajectories lost (admitted answers of a group trained only in part, steps
short of a batch) and trained twice, the largest staleness against eta, held-out accuracy after,
and the effective training throughput.

--quick: one seed, 60 steps, a kill every 20: a smoke check that writes
bench/results/quick/preemption.json; no figure to quote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd

from bench.common import REPO_ROOT, format_table
from bench.learning import mean_std, runs_root, say

CONFIG = "configs/quickstart.yaml"
KEY_ENV = "AREAL_BENCH_ROLLOUT_KEY"
JOIN_AFTER_S = 10.0


def _base_model(root: Path) -> str:
    """A model folder of the quickstart's architecture for the servers to start from (each run then
    loads its own first version into them; a joining server gets the current weights)."""
    from areal_core.experiment import load_config
    from areal_core.models import build_char_tokenizer, build_tiny

    folder = root / "base"
    if not (folder / "config.json").exists():
        tok = build_char_tokenizer()
        build_tiny(load_config(REPO_ROOT / CONFIG).model.tiny, tok, seed=0).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


class Pool:
    """The servers of one run: started, killed and replaced here."""

    def __init__(self, base: str, key: str, log_dir: Path):
        self.base, self.key, self.log_dir, self.servers, self.n = base, key, log_dir, [], 0

    def start(self):
        from areal_core.rollout.backends.embedded.launcher import start_server

        self.n += 1
        s = start_server(
            self.base, api_key=self.key, log_path=str(self.log_dir / f"server{self.n}.log"), max_running=256
        )
        self.servers.append(s)
        return s

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def _steps_done(run_dir: Path) -> int:
    try:
        return int(pd.read_parquet(run_dir / "metrics.parquet")["step"].max())
    except (OSError, ValueError, KeyError):
        return 0


def one_run(label: str, seed: int, steps: int, kill_every: int | None, root: Path) -> dict:
    from areal_core.controller.elastic import announce
    from areal_core.rollout.auth import new_key

    run_dir, log_dir = root / label, root / f"{label}-servers"
    for d in (run_dir, log_dir):
        shutil.rmtree(d, ignore_errors=True)
    log_dir.mkdir(parents=True)
    key, join = new_key(), str(log_dir / "join.txt")
    pool = Pool(_base_model(root), key, log_dir)
    first = [pool.start(), pool.start()]
    announce(join, [s.url for s in first])
    sets = [
        f"seed={seed}",
        f"trainer.max_steps={steps}",
        "rollout.min_servers=1",
        f"rollout.join_from={join}",
        f"rollout.backend={{kind: external, urls: [{first[0].url}, {first[1].url}], api_key_env: {KEY_ENV}}}",
    ]
    cmd = [str(REPO_ROOT / ".venv/bin/areal-flow"), "train", CONFIG, "--run-dir", str(run_dir), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    say(f"{label}: {' '.join(cmd[1:])}")
    events: list[dict] = []
    t0 = time.perf_counter()
    with open(root / f"{label}.log", "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, KEY_ENV: key}
        )
        try:
            next_kill = kill_every
            while proc.poll() is None:
                time.sleep(0.5)
                if next_kill is None or _steps_done(run_dir) < next_kill or next_kill >= steps:
                    continue
                live = [s for s in pool.servers if s.alive()]
                if len(live) < 2:  # the last replacement has not come up yet: kill once it has
                    continue
                victim = live[0]  # the oldest: every server is replaced in turn
                victim._signal(signal.SIGKILL)
                announce(join, [victim.url], present=False)  # (the run copes with a stale entry too)
                events.append({"step": next_kill, "killed": victim.url, "t": time.perf_counter() - t0})

                def replace(event: dict) -> None:
                    time.sleep(JOIN_AFTER_S)
                    s = pool.start()
                    announce(join, [s.url])
                    event["joined"], event["joined_t"] = s.url, time.perf_counter() - t0

                threading.Thread(target=replace, args=(events[-1],), daemon=True).start()
                next_kill += kill_every
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
            pool.stop()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{label} exited with {rc}; see {root / (label + '.log')}")
    return run_row(label, seed, kill_every, run_dir, wall, events)


def run_row(label: str, seed: int, kill_every: int | None, run_dir: Path, wall: float, events: list[dict]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    ledger = pd.read_parquet(run_dir / "ledger.parquet")
    n, batch = cfg["rollout"]["n_samples"], cfg["trainer"]["batch_size"]
    per_group = ledger["trajectory_id"].str.rsplit("-s", n=1).str[0].value_counts()
    per_step = ledger.groupby("step").size()
    lost = (
        int((n - per_group[per_group < n]).sum())
        + int((batch - per_step[per_step < batch]).sum())
        + batch * len(summary["ledger_check"]["missing_steps"])
    )
    row = {
        "label": label,
        "seed": seed,
        "kill_every": kill_every,
        "run_dir": str(run_dir),
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "gain": summary["accuracy_after"] - summary["accuracy_before"],
        "trajectories_lost": lost,
        "trajectories_duplicated": int(ledger["trajectory_id"].duplicated().sum()),
        "max_staleness": int((ledger["trained_by_version"] - ledger["min_token_version"]).max()),
        "eta": cfg["trainer"]["eta"],
        "ledger_ok": summary["ledger_check"]["ok"],
        "tokens_per_s": summary["effective_train_tokens_per_s"],
        "rl_time_s": summary["rl_time_s"],
        "wall_s": wall,
        "pool": summary["rollout_pool"],
        "resubmits": summary["rollout_resubmits"],
        "events": events,
    }
    say(
        f"{label}: {row['before']:.3f} -> {row['after']:.3f}, lost {lost}, twice {row['trajectories_duplicated']}, "
        f"staleness <= {row['max_staleness']} (eta {row['eta']}), {row['tokens_per_s']:.0f} tok/s, "
        f"{len(summary['rollout_pool']['left'])} left / {len(summary['rollout_pool']['joined'])} joined"
    )
    return row


def pool_summary(steady: list[dict], hit: list[dict]) -> dict:
    """What the preempted runs (``hit``) lost, trained twice and cost against the undisturbed ones
    (``steady``, seed by seed)."""
    return {
        "trajectories_lost": sum(r["trajectories_lost"] for r in hit),
        "trajectories_duplicated": sum(r["trajectories_duplicated"] for r in hit),
        "max_staleness": max(r["max_staleness"] for r in hit),
        "eta": hit[0]["eta"],
        "servers_left": sum(len(r["pool"]["left"]) for r in hit),
        "servers_joined": sum(len(r["pool"]["joined"]) for r in hit),
        "gain_preempted": mean_std([r["gain"] for r in hit]),
        "gain_undisturbed": mean_std([r["gain"] for r in steady]),
        "throughput_preempted_over_undisturbed": [h["tokens_per_s"] / s["tokens_per_s"] for s, h in zip(steady, hit)],
    }


def run(quick: bool) -> dict:
    root = runs_root("preemption" + ("_quick" if quick else ""))
    root.mkdir(parents=True, exist_ok=True)
    seeds, steps, every = ((0,), 60, 20) if quick else ((0, 1), 200, 25)
    rows = []
    for seed in seeds:  # per seed: undisturbed, then preempted (one after the other: each has the machine)
        rows.append(one_run(f"steady-s{seed}", seed, steps, None, root))
        rows.append(one_run(f"preempted-s{seed}", seed, steps, every, root))
    steady = [r for r in rows if r["kill_every"] is None]
    hit = [r for r in rows if r["kill_every"] is not None]
    table = [
        (
            f"preempted every {every} steps" if r["kill_every"] else "undisturbed",
            r["seed"],
            r["after"],
            r["gain"],
            r["trajectories_lost"],
            r["trajectories_duplicated"],
            f"{r['max_staleness']} / {r['eta']}",
            r["tokens_per_s"],
            len(r["pool"]["left"]),
            len(r["pool"]["joined"]),
        )
        for r in rows
    ]
    print(
        format_table(
            [
                "pool",
                "seed",
                "held-out after",
                "gain",
                "lost",
                "trained twice",
                "staleness / eta",
                "train tok/s",
                "left",
                "joined",
            ],
            table,
            title=f"quickstart, {steps} steps, 2 servers (external, distributed transport)",
        )
    )
    summary = pool_summary(steady, hit)
    ratios = summary["throughput_preempted_over_undisturbed"]
    print(f"preempted / undisturbed training throughput per seed: {', '.join(f'{x:.3f}' for x in ratios)}")
    return {"rows": rows, "summary": summary}
