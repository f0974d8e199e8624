"""TRL's ``GRPOTrainer`` as a peer: TRL vs areal-flow synchronous vs areal-flow asynchronous.

    python -m bench trl_peer [--quick]     # creates bench/.venvs/trl on first use (~1-2 min, PyPI)
    make bench-trl                         # the same venv, ahead of time

All three train the same tiny random Qwen2 (0.53M parameters, hidden 128, 2 layers, the
project's byte-level tokenizer), saved once as an HF folder that both sides load, on the
same 512 arithmetic prompts (``Compute 3+4*2-5 =``, integer answers, generated from a seed
and written as an areal-flow records file whose prompts and answers TRL reads too), with P
prompts x G answers per step, up to T new tokens at temperature 1, fp32, the same steps and
2 cores:

* TRL 1.16.0 (pinned, its own venv ``bench/.venvs/trl``, gitignored; ``bench/trl_worker.py``
  runs there): fully on-policy ``GRPOTrainer`` (per_device_train_batch_size P*G,
  num_generations G, gradient_accumulation_steps 1, beta 0, use_vllm False), 2 torch threads;
* areal-flow sync and async: ``run_experiment`` on :func:`areal_config` (one rollout server
  with 1 thread; the trainer with the default split: both cores in sync, where generation is
  idle while it trains, the other core in async; grading in one Dask worker process).

Reward: +5 / -5 for an exact integer final answer on both sides (areal-flow's math grader;
TRL's reward function applies the same extraction rules); a random model scores ~0 anyway.

Measured: effective train tokens/s, generated tokens consumed by updates per second of wall
time after WARMUP steps (areal-flow's ``effective_train_tokens_per_s``; for TRL the same
from its logged completion lengths and the wall clock at each step's end), and each
system's per-step tokens/s after warm-up as median [min, max] (the spread). Full mode: two
settings (SETTINGS), STEPS_FULL steps; --quick: the first setting, STEPS_QUICK steps.
Absolute figures depend on what else the machine runs; the ratios are measured back to back.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, format_table, install_venv, ratio, spread, venv_install_commands

VENV = REPO_ROOT / "bench" / ".venvs" / "trl"
PY = VENV / "bin" / "python"
WORKER = REPO_ROOT / "bench" / "trl_worker.py"
INSTALL = [
    ["{py}", "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0"],
    ["{py}", "-m", "pip", "install", "-q", "--disable-pip-version-check", "trl==1.16.0"],
]
# (P prompts per step, G answers per prompt, T max new tokens)
SETTINGS = ((8, 4, 64), (16, 8, 128))
STEPS_FULL, STEPS_QUICK, WARMUP = 30, 6, 2
N_PROMPTS, N_EVAL, SEED, LR = 512, 8, 0, 1e-4
CORES = 2
REWARD_CORRECT, REWARD_WRONG = 5.0, -5.0
MODES = (("areal-flow sync", "sync"), ("areal-flow async", "async"))


# --- the TRL venv -------------------------------------------------------------------------------

def install_commands() -> str:
    return venv_install_commands(VENV, INSTALL)


def _import_trl() -> subprocess.CompletedProcess:
    return subprocess.run([str(PY), "-c", "import trl, sys; sys.stdout.write(trl.__version__)"],
                          capture_output=True, text=True, timeout=300, env=_clean_env())


def unavailable() -> str | None:
    """Why TRL cannot be benchmarked here, or None when its venv imports it."""
    if not PY.exists():
        return f"no venv at {VENV}; create it with: make bench-trl (or: {install_commands()})"
    r = _import_trl()
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode
        return f"`import trl` fails in {VENV}: {tail}"
    return None


def ensure_venv(log_path: str) -> str | None:
    """Create and fill the venv if TRL does not import from it; returns why that failed, or None."""
    if unavailable() is None:
        return None
    failed = install_venv(VENV, INSTALL, log_path)
    return failed or unavailable()


def _clean_env() -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(k, None)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": str(CORES), "DO_NOT_TRACK": "1"})
    return env


# --- the shared inputs --------------------------------------------------------------------------

def arithmetic_problem(rng: random.Random) -> tuple[str, int]:
    """``Compute 3+4*2-5 =`` (3 or 4 digits 1-9, operators + - *) and its value (* before + and -)."""
    digits = [rng.randint(1, 9) for _ in range(rng.choice((3, 4)))]
    ops = [rng.choice("+-*") for _ in digits[1:]]
    terms, signs = [digits[0]], [1]
    for op, d in zip(ops, digits[1:]):
        if op == "*":
            terms[-1] *= d
        else:
            terms.append(d)
            signs.append(1 if op == "+" else -1)
    text = str(digits[0]) + "".join(f"{op}{d}" for op, d in zip(ops, digits[1:]))
    return f"Compute {text} =", sum(s * t for s, t in zip(signs, terms))


def write_records_file(path: Path, n: int, seed: int, prefix: str) -> None:
    from areal_core.data.records import Record, write_records

    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt, value = arithmetic_problem(rng)
        records.append(Record(id=f"{prefix}-{i}", task="math", prompt=prompt, answer=str(value), source="bench.trl_peer"))
    write_records(records, str(path))


def write_model_folder(path: Path, seed: int) -> int:
    """The tiny random Qwen2 + the byte-level tokenizer as an HF folder; returns its parameter count."""
    from areal_core.models.config import TinyArch
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_char_tokenizer()
    model = build_tiny(TinyArch(), tokenizer, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


# --- areal-flow ---------------------------------------------------------------------------------

def areal_config(mode: str, model_dir: str, records: str, eval_records: str, P: int, G: int, T: int, steps: int,
                 scheduler_address: str | None):
    """The ExperimentConfig of one areal-flow run: ``mode`` "sync" (eta 0, in-flight sequences finish
    under the old weights) or "async" (eta 4, weight updates interrupt and re-prefill).
    Every areal-flow config key this benchmark depends on is here."""
    from areal_core.experiment import parse_config

    if mode not in ("sync", "async"):
        raise ValueError(f"areal_config: mode must be 'sync' or 'async', got {mode!r}")
    data = {
        "name": f"trl-peer-{mode}", "seed": SEED,
        "model": {"name": model_dir, "dtype": "float32"},  # an HF folder: loaded as is, no warm start
        "data": {"dataset": records, "eval_dataset": eval_records, "shuffle": True},
        "rollout": {"backend": "embedded", "n_servers": 1, "n_samples": G, "torch_threads": 1,
                    "weight_update": "reprefill" if mode == "async" else "drain",
                    "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": T}},
        "trainer": {"batch_size": P * G, "eta": 4 if mode == "async" else 0, "max_steps": steps,
                    "adv_norm": "group", "reward_correct": REWARD_CORRECT, "reward_wrong": REWARD_WRONG,
                    "warmup_steps_for_throughput": WARMUP, "optim": {"lr": LR}},  # threads: the default split
        "reward": {"n_workers": 1, "scheduler_address": scheduler_address},
        "eval": {"n_problems": N_EVAL, "max_new_tokens": 8},  # outside the measured time; kept small
    }
    return parse_config(data, source="bench/trl_peer.py:areal_config")


def per_step_rates(tokens: list[int], seconds: list[float]) -> dict:
    """Spread of tokens/s over the steps after warm-up."""
    rates = [t / s for t, s in zip(tokens[WARMUP:], seconds[WARMUP:])]
    return spread(rates) if rates else {}


def run_areal(mode: str, inputs: dict, P: int, G: int, T: int, steps: int, run_dir: Path, scheduler: str) -> dict:
    import pandas as pd

    from areal_core.run import run_experiment

    cfg = areal_config(mode, inputs["model"], inputs["records"], inputs["eval"], P, G, T, steps, scheduler)
    summary = run_experiment(cfg, run_dir, max_steps=steps, progress=False)
    m = pd.read_parquet(run_dir / "metrics.parquet").sort_values("step")
    return {"effective_train_tokens_per_s": summary["effective_train_tokens_per_s"],
            "per_step_tokens_per_s": per_step_rates(m["tokens_trained"].tolist(), m["step_time_s"].tolist()),
            "mean_step_s": float(m["step_time_s"].iloc[WARMUP:].mean()),
            "tokens_trained": summary["tokens_trained"], "reward_mean": float(m["reward"].mean()),
            "max_staleness_observed": summary["max_staleness_observed"], "rl_time_s": summary["rl_time_s"],
            "run_dir": str(run_dir)}


# --- TRL ----------------------------------------------------------------------------------------

def trl_throughput(rows: list[dict], train_start_s: float) -> dict:
    """Effective train tokens/s after WARMUP steps, from TRL's per-step end times and completion tokens."""
    ends = [r["end_s"] for r in rows]
    tokens = [r["completion_tokens"] for r in rows]
    seconds = [b - a for a, b in zip([train_start_s] + ends[:-1], ends)]
    if len(rows) > WARMUP:
        eff = sum(tokens[WARMUP:]) / (ends[-1] - ends[WARMUP - 1] if WARMUP else ends[-1] - train_start_s)
    else:
        eff = sum(tokens) / (ends[-1] - train_start_s)
    return {"effective_train_tokens_per_s": eff, "per_step_tokens_per_s": per_step_rates(tokens, seconds),
            "mean_step_s": sum(seconds[WARMUP:]) / max(len(seconds) - WARMUP, 1), "tokens_trained": sum(tokens)}


def run_trl(inputs: dict, P: int, G: int, T: int, steps: int, work_dir: Path) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = {"model": inputs["model"], "records": inputs["records"], "prompts_per_step": P, "answers_per_prompt": G,
            "max_new_tokens": T, "steps": steps, "threads": CORES, "lr": LR, "seed": SEED,
            "reward_correct": REWARD_CORRECT, "reward_wrong": REWARD_WRONG, "work_dir": str(work_dir / "trainer")}
    spec_path, out_path, log_path = work_dir / "spec.json", work_dir / "out.json", work_dir / "trl.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    with open(log_path, "wb") as log:
        r = subprocess.run([str(PY), str(WORKER), str(spec_path), str(out_path)], stdout=log,
                           stderr=subprocess.STDOUT, env=_clean_env(), cwd=str(work_dir))
    if r.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"TRL worker exited with {r.returncode}; log {log_path}:\n{tail}")
    out = json.loads(out_path.read_text())
    rewards = [s["reward"] for s in out["steps"] if s.get("reward") is not None]
    return {**trl_throughput(out["steps"], out["train_start_s"]), "versions": out["versions"],
            "torch_threads": out["torch_threads"], "setup_s": out["setup_s"],
            "reward_mean": sum(rewards) / len(rewards) if rewards else None, "log": str(log_path)}


# --- the benchmark ------------------------------------------------------------------------------

def prepare_inputs(root: Path) -> dict:
    model = root / "tiny-qwen2"
    n_params = write_model_folder(model, SEED)
    write_records_file(root / "arith_train.jsonl", N_PROMPTS, SEED, "arith")
    write_records_file(root / "arith_eval.jsonl", N_EVAL, SEED + 1, "arith-eval")
    return {"model": str(model), "records": str(root / "arith_train.jsonl"), "eval": str(root / "arith_eval.jsonl"),
            "n_params": n_params}


def run_setting(inputs: dict, P: int, G: int, T: int, steps: int, root: Path, scheduler: str) -> dict:
    tag = f"P{P}xG{G}_T{T}"
    jobs = [("TRL GRPOTrainer", lambda: run_trl(inputs, P, G, T, steps, root / tag / "trl"))]
    jobs += [(label, lambda mode=mode: run_areal(mode, inputs, P, G, T, steps, root / tag / mode, scheduler))
             for label, mode in MODES]
    runs = {}
    for label, job in jobs:
        print(f"{tag}: {label}, {steps} steps ...", flush=True)
        load_before = os.getloadavg()[0]
        runs[label] = {**job(), "load_avg_1m": [load_before, os.getloadavg()[0]]}
    eff = {k: v["effective_train_tokens_per_s"] for k, v in runs.items()}
    trl, sync, asyn = eff["TRL GRPOTrainer"], eff["areal-flow sync"], eff["areal-flow async"]
    return {"setting": {"prompts_per_step": P, "answers_per_prompt": G, "max_new_tokens": T, "steps": steps},
            "runs": runs, "async_over_trl": ratio(asyn, trl), "async_over_sync": ratio(asyn, sync),
            "sync_over_trl": ratio(sync, trl)}


def print_table(tag: str, res: dict) -> None:
    trl = res["runs"]["TRL GRPOTrainer"]["effective_train_tokens_per_s"]
    rows = []
    for label, r in res["runs"].items():
        s = r["per_step_tokens_per_s"]
        rows.append((label, r["effective_train_tokens_per_s"], ratio(r["effective_train_tokens_per_s"], trl),
                     s.get("median"), s.get("min"), s.get("max"), r["mean_step_s"], r["reward_mean"],
                     max(r["load_avg_1m"])))
    st = res["setting"]
    print(format_table(["system", "eff. train tok/s", "vs TRL", "step tok/s med", "min", "max", "step s", "reward",
                        "load 1m"], rows, title=f"{tag}: {st['steps']} steps, warm-up {WARMUP} excluded, {CORES} cores"))
    busiest = max(max(r["load_avg_1m"]) for r in res["runs"].values())
    if busiest > CORES:
        print(f"note: load average up to {busiest:.1f} on {os.cpu_count()} cores: other work shared the cores, "
              f"and TRL's {CORES} OpenMP threads suffer most from that; compare on an idle machine", flush=True)


def run(quick: bool) -> dict:
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    root = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    reason = unavailable()
    if reason is not None:
        print(f"TRL not importable ({reason}); installing it into {VENV} (1-2 minutes)", flush=True)
        reason = ensure_venv(str(root / "trl-install.log"))
        if reason is not None:
            raise RuntimeError(f"TRL peer benchmark cannot run: {reason}")
    inputs = prepare_inputs(root)
    steps = STEPS_QUICK if quick else STEPS_FULL
    settings = SETTINGS[:1] if quick else SETTINGS
    results = {}
    with RewardService(RewardConfig(n_workers=1)) as shared:  # one Dask cluster serves both areal-flow runs
        for P, G, T in settings:
            tag = f"P{P}xG{G}_T{T}"
            results[tag] = run_setting(inputs, P, G, T, steps, root, shared.scheduler_address)
            print_table(tag, results[tag])
    first = results[next(iter(results))]
    summary = {f"trl_peer_{k}": first[k] for k in ("async_over_trl", "async_over_sync", "sync_over_trl")}
    for tag, res in list(results.items())[1:]:
        summary.update({f"trl_peer_{k}_{tag}": res[k] for k in ("async_over_trl", "async_over_sync", "sync_over_trl")})
    return {
        "setup": {"model": f"tiny random Qwen2, {inputs['n_params']:,} parameters, byte-level tokenizer",
                  "prompts": f"{N_PROMPTS} arithmetic prompts (Compute 3+4*2-5 =), seed {SEED}",
                  "steps": steps, "warmup_steps_excluded": WARMUP, "cores": CORES, "lr": LR,
                  "rewards": [REWARD_CORRECT, REWARD_WRONG],
                  "settings": [{"P": P, "G": G, "max_new_tokens": T} for P, G, T in settings],
                  "trl_worker": str(WORKER.relative_to(REPO_ROOT)), "work_dir": str(root)},
        "settings": results,
        "summary": summary,
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench trl_peer [--quick]")
