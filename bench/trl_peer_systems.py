"""The three systems of the TRL peer benchmarks, each run once on a :class:`~bench.trl_peer_inputs.Workload`
and measured the same way: TRL's ``GRPOTrainer`` (``bench/trl_worker.py`` in TRL's own venv) and
areal-flow synchronous and asynchronous (``run_experiment`` on ``areal_config``).

Measured: effective train tokens/s, the generated tokens consumed by updates per second of wall
time after WARMUP steps (areal-flow's ``effective_train_tokens_per_s``; for TRL the same from the
tokens of each step's completions and the wall clock at each step's end), and per-step tokens/s
after warm-up (median, min, max). TRL's run is also timed by two other clocks, the wall time of the
whole ``train()`` call and TRL's own ``train_runtime``, which cover every step (warm-up included):
``clocks`` puts the three side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.common import REPO_ROOT, install_venv, spread, venv_install_commands
from bench.trl_peer_inputs import CORES, WARMUP, Workload, areal_config, trl_spec

VENV = REPO_ROOT / "bench" / ".venvs" / "trl"
PY = VENV / "bin" / "python"
WORKER = REPO_ROOT / "bench" / "trl_worker.py"
INSTALL = [
    ["{py}", "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0"],
    ["{py}", "-m", "pip", "install", "-q", "--disable-pip-version-check", "trl==1.16.0"],
]
TRL = "TRL GRPOTrainer"
MODES = (("areal-flow sync", "sync"), ("areal-flow async", "async"))
SYSTEMS = (TRL,) + tuple(label for label, _ in MODES)


# --- the TRL venv -------------------------------------------------------------------------------


def install_commands() -> str:
    return venv_install_commands(VENV, INSTALL)


def unavailable() -> str | None:
    """Why TRL cannot be benchmarked here, or None when its venv imports it."""
    if not PY.exists():
        return f"no venv at {VENV}; create it with: make bench-trl (or: {install_commands()})"
    r = subprocess.run(
        [str(PY), "-c", "import trl, sys; sys.stdout.write(trl.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode
        return f"`import trl` fails in {VENV}: {tail}"
    return None


def ensure_venv(log_path: str) -> None:
    """Create and fill the venv if TRL does not import from it; raises why that failed."""
    reason = unavailable()
    if reason is None:
        return
    print(f"TRL not importable ({reason}); installing it into {VENV} (1-2 minutes)", flush=True)
    reason = install_venv(VENV, INSTALL, log_path) or unavailable()
    if reason is not None:
        raise RuntimeError(f"the TRL peer benchmark cannot run: {reason}")


def clean_env(threads: int = CORES) -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(k, None)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
            "DO_NOT_TRACK": "1",
        }
    )
    return env


# --- TRL ----------------------------------------------------------------------------------------


def per_step_rates(tokens: list[int], seconds: list[float]) -> dict:
    """Spread of tokens/s over the steps after warm-up."""
    rates = [t / s for t, s in zip(tokens[WARMUP:], seconds[WARMUP:])]
    return spread(rates) if rates else {}


def trl_throughput(out: dict) -> dict:
    """TRL's figures from the worker's OUT.json: effective train tokens/s after WARMUP steps, per-step
    spread, CPU seconds of the worker per 1,000 tokens after warm-up, and the three clocks."""
    rows, start = out["steps"], out["train_start_s"]
    if len(rows) <= WARMUP:
        raise ValueError(f"TRL ran {len(rows)} steps: nothing left after {WARMUP} warm-up steps")
    ends = [r["end_s"] for r in rows]
    tokens = [r["completion_tokens"] for r in rows]
    seconds = [b - a for a, b in zip([start] + ends[:-1], ends)]
    measured = sum(tokens[WARMUP:])
    eff = measured / (ends[-1] - ends[WARMUP - 1] if WARMUP else ends[-1] - start)
    result = {
        "effective_train_tokens_per_s": eff,
        "per_step_tokens_per_s": per_step_rates(tokens, seconds),
        "mean_step_s": sum(seconds[WARMUP:]) / (len(seconds) - WARMUP),
        "tokens_trained": sum(tokens),
    }
    if "cpu_s" in rows[0]:
        cpu0 = rows[WARMUP - 1]["cpu_s"] if WARMUP else out["train_start_cpu_s"]
        result["cpu_s_per_1k_tokens"] = 1000 * (rows[-1]["cpu_s"] - cpu0) / measured
    runtime = out.get("trl_metrics", {}).get("train_runtime")
    if runtime:
        total = sum(tokens)
        result["clocks"] = {  # every step, warm-up included
            "step_clock_tokens_per_s": total / (ends[-1] - start),
            "train_call_tokens_per_s": total / out["train_call_s"],
            "trl_train_runtime_tokens_per_s": total / runtime,
            "trl_train_runtime_s": runtime,
            "train_call_s": out["train_call_s"],
            "trl_train_samples_per_second": out["trl_metrics"].get("train_samples_per_second"),
        }
    return result


def trl_snapshots(out: dict) -> list[dict]:
    """The worker's saved folders (``save_every``), each with its training seconds: the wall clock from
    the start of ``train()`` to the end of its step, less the saves before it."""
    saves = sorted(out.get("snapshots", []), key=lambda x: x["step"])
    ends = {r["step"]: r["end_s"] for r in out["steps"]}
    return [
        {
            "step": x["step"],
            "model": x["dir"],
            "train_s": ends[x["step"]] - out["train_start_s"] - sum(y["save_s"] for y in saves[:i]),
        }
        for i, x in enumerate(saves)
    ]


def areal_snapshots(run_dir: Path, metrics) -> list[dict]:
    """The run's checkpoints after training steps (``RUN/checkpoints/vN``, version N after step N; v0,
    the model it started from, is not one), each with its training seconds: the run's elapsed time at
    the end of step N less the checkpoint writes up to it."""
    m = metrics.sort_values("step")
    train_s = m["elapsed_s"] - m["checkpoint_time_s"].fillna(0.0).cumsum()
    at = dict(zip(m["step"].astype(int), train_s.astype(float)))
    folders = sorted(
        (p for p in (run_dir / "checkpoints").glob("v*") if p.name[1:].isdigit() and int(p.name[1:]) in at),
        key=lambda p: int(p.name[1:]),
    )
    return [{"step": int(p.name[1:]), "model": str(p), "train_s": at[int(p.name[1:])]} for p in folders]


def run_trl(w: Workload, work_dir: Path, threads: int = CORES, trl_args: dict | None = None) -> dict:
    """One TRL run of ``w`` in the TRL venv (``trl_args``: GRPOConfig overrides)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = work_dir / "spec.json", work_dir / "out.json", work_dir / "trl.log"
    spec_path.write_text(json.dumps(trl_spec(w, work_dir, threads, trl_args), indent=2))
    with open(log_path, "wb") as log:
        r = subprocess.run(
            [str(PY), str(WORKER), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(threads),
            cwd=str(work_dir),
        )
    if r.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"TRL worker exited with {r.returncode}; log {log_path}:\n{tail}")
    out = json.loads(out_path.read_text())
    rewards = [s["reward"] for s in out["steps"] if s.get("reward") is not None]
    return {
        **trl_throughput(out),
        "versions": out["versions"],
        "torch_threads": out["torch_threads"],
        "torch_threads_per_step": sorted({s["torch_threads"] for s in out["steps"]}),
        "setup_s": out["setup_s"],
        "tokenizer": out["tokenizer"],
        "grpo_args": out["grpo_args"],
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "snapshots": trl_snapshots(out),
        "log": str(log_path),
    }


# --- areal-flow ---------------------------------------------------------------------------------


def run_areal(mode: str, w: Workload, run_dir: Path, reward: dict | None) -> dict:
    """One areal-flow run of ``w``: ``mode`` sync or async (see ``areal_config``)."""
    import pandas as pd

    from areal_core.run.setup import run_experiment

    summary = run_experiment(areal_config(mode, w, reward), run_dir, max_steps=w.steps, progress=False)
    m = pd.read_parquet(run_dir / "metrics.parquet").sort_values("step")
    return {
        "effective_train_tokens_per_s": summary["effective_train_tokens_per_s"],
        "per_step_tokens_per_s": per_step_rates(m["tokens_trained"].tolist(), m["step_time_s"].tolist()),
        "mean_step_s": float(m["step_time_s"].iloc[WARMUP:].mean()),
        **step_parts(m),
        "tokens_trained": summary["tokens_trained"],
        "reward_mean": float(m["reward"].mean()),
        "max_staleness_observed": summary["max_staleness_observed"],
        "dtypes": {"trainer": summary["dtype"], "servers": summary["rollout_dtype"]},
        "rl_time_s": summary["rl_time_s"],
        "snapshots": areal_snapshots(run_dir, m) if w.snapshot_every else [],
        "run_dir": str(run_dir),
    }


def step_parts(m) -> dict:
    """Where an areal-flow step's time went after warm-up (means over the steps of ``metrics.parquet``'s
    ``m``): training, and waiting for the rollout servers' answers (what asynchrony takes off a step);
    the servers' generating seconds; with core lending, the trainer's seconds on its own threads and
    on the lent ones too (None without lending)."""
    after = m.iloc[WARMUP:]
    parts = {
        "mean_train_s": float(after["train_time_s"].mean()),
        "mean_rollout_wait_s": float(after["cost_trainer_waiting_rollout_s"].mean()),
        "mean_generating_s": float(after["cost_rollout_generating_s"].mean()),
    }
    for key, col in (
        ("mean_own_threads_s", "trainer_own_threads_s"),
        ("mean_lent_threads_s", "trainer_lent_threads_s"),
    ):
        xs = after[col].dropna()
        parts[key] = float(xs.mean()) if len(xs) else None
    return parts


def system_dir(label: str, work_dir: Path) -> Path:
    """Where ``run_system`` runs ``label`` (one of SYSTEMS) under ``work_dir``."""
    return work_dir / ("trl" if label == TRL else dict(MODES)[label])


def run_system(label: str, w: Workload, work_dir: Path, reward: dict | None) -> dict:
    """``label`` (one of SYSTEMS) on ``w`` in ``work_dir``, with the 1-minute load average before and after."""
    load_before = os.getloadavg()[0]
    if label == TRL:
        result = run_trl(w, system_dir(label, work_dir))
    else:
        result = run_areal(dict(MODES)[label], w, system_dir(label, work_dir), reward)
    return {**result, "load_avg_1m": [load_before, os.getloadavg()[0]]}
