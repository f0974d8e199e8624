"""Sampling flips from batch composition, what the batch-invariant mode costs, and runs that repeat
under load.

Every request is seeded (keyed sampling: the token at position p drawn from (seed, p)), so two
generations of one request can differ only where the logits differ. For each model: each of N
requests generated alone, and the same requests together in one batch whose members finish at
different lengths (so the batch shrinks under them); a *flip* is a request whose tokens part ways
(counted per million tokens compared up to it), and logprob mismatches count positions whose
logprob differs in any bit. Default mode and batch-invariant mode (``rollout.batch_invariant``)
side by side. Cost: output tokens/s of the engine at batch 64 in both modes, alternating within
each repetition (one core, float32, as a rollout server runs).

Repeats (the quickstart, in the dtype ``model.dtype: auto`` picks here): two synchronous runs with
one seed (eta 0, drained updates, 20 steps) while two busy-loop processes take the machine's cores
must train the same trajectories at every step and end with the same weights; an asynchronous run of
30 steps (idle), replayed from its checkpoint v10 with ``areal-flow replay``, must reproduce its last
checkpoint. The record names the CPU kind and the kernels (``areal_core.numerics.cpu_kind``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import random
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from areal_core.numerics import cpu_kind, kind_label
from bench.common import REPO_ROOT, format_table, median, spread
from bench.learning import runs_root, say, train

PROMPT = 16


def _generate(model, jobs, invariant: bool) -> tuple[list, float]:
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    eng = RolloutEngine(model, max_running=max(1, len(jobs)), start=False, batch_invariant=invariant)
    t0 = time.perf_counter()
    futs = eng.submit_many(jobs)
    while eng.step():
        pass
    return [f.result() for f in futs], time.perf_counter() - t0


def _jobs(n: int, vocab: int, new: int, seed: int, varied: bool) -> list:
    r = random.Random(seed)
    return [
        (
            [r.randrange(3, vocab) for _ in range(PROMPT)],
            {
                "temperature": 1.0,
                "max_new_tokens": r.randrange(new // 4, new + 1) if varied else new,
                "ignore_eos": True,
                "sampling_seed": 1000 + i,
            },
            f"r{i}",
        )
        for i in range(n)
    ]


def flips(model, n: int, new: int, vocab: int, invariant: bool) -> dict:
    jobs = _jobs(n, vocab, new, 0, varied=True)
    together, _ = _generate(model, jobs, invariant)
    compared = flipped = lp_diff = 0
    for job, b in zip(jobs, together):
        a = _generate(model, [job], invariant)[0][0]
        k = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), None)
        upto = len(a.output_ids) if k is None else k + 1
        compared += upto
        flipped += k is not None
        la = [x[0] for x in a.meta_info.output_token_logprobs[:upto]]
        lb = [x[0] for x in b.meta_info.output_token_logprobs[:upto]]
        lp_diff += sum(x != y for x, y in zip(la, lb))
    return {
        "requests": n,
        "tokens_compared": compared,
        "flipped_requests": flipped,
        "flips_per_million_tokens": flipped / compared * 1e6,
        "logprob_mismatch_share": lp_diff / compared,
    }


def cost(model, new: int, vocab: int, reps: int) -> dict:
    jobs = _jobs(64, vocab, new, 1, varied=False)
    _generate(model, jobs[:8], False), _generate(model, jobs[:8], True)  # warm-up
    tps = {False: [], True: []}
    for _ in range(reps):
        for inv in (False, True):
            out, s = _generate(model, jobs, inv)
            tps[inv].append(sum(len(o.output_ids) for o in out) / s)
    ratios = [i / d for d, i in zip(tps[False], tps[True])]
    return {
        "default_tokens_per_s": median(tps[False]),
        "invariant_tokens_per_s": median(tps[True]),
        "invariant_over_default": median(ratios),
        "ratio_spread": spread(ratios),
        "reps": reps,
    }


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_loops(n: int):
    """``n`` processes that each keep a core busy for the block's duration."""
    procs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def _trained(run_dir: Path) -> dict[int, list[str]]:
    """Each step's trajectory ids, in the trainer's order (the run's schedule)."""
    steps = sorted((run_dir / "schedule").glob("step-*.parquet"))
    return {int(p.stem.split("-")[1]): pd.read_parquet(p, columns=["traj_id"])["traj_id"].tolist() for p in steps}


def _final_hash(run_dir: Path) -> str:
    return pd.read_parquet(run_dir / "metrics.parquet")["weights_sha256"].dropna().iloc[-1]


def sync_repeat_under_load(root: Path, steps: int) -> dict:
    """Two synchronous runs with one seed while two busy loops run: what they trained and their weights."""
    sets = ("trainer.eta=0", "rollout.weight_update=drain", f"trainer.max_steps={steps}")
    with busy_loops(2):
        runs = [train(f"sync-{k}", 0, sets, root) for k in ("a", "b")]
    a, b = (_trained(Path(r["run_dir"])) for r in runs)
    shared = sum(len(set(a[s]) & set(b.get(s, []))) for s in a)
    return {
        "steps": steps,
        "busy_loops": 2,
        "same_trajectories_every_step": a == b,
        "trajectories": sum(len(v) for v in a.values()),
        "shared_trajectories": shared,
        "final_hashes": [_final_hash(Path(r["run_dir"])) for r in runs],
        "same_final_weights": len({_final_hash(Path(r["run_dir"])) for r in runs}) == 1,
        "wall_s": [r["command_wall_s"] for r in runs],
    }


def async_replay(root: Path, steps: int, from_step: int) -> dict:
    """An asynchronous run of ``steps`` steps, replayed from its checkpoint ``from_step``."""
    run = Path(train("async", 0, (f"trainer.max_steps={steps}",), root)["run_dir"])
    out = root / "async-replay"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        str(REPO_ROOT / ".venv/bin/areal-flow"),
        "replay",
        str(run),
        "--out",
        str(out),
        "--from-step",
        str(from_step),
    ]
    say(" ".join(cmd[1:]) + " --no-prefect")
    proc = subprocess.run([*cmd, "--no-prefect"], cwd=REPO_ROOT, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "steps": steps,
        "from_step": from_step,
        "rc": proc.returncode,
        "lines": [x for x in proc.stdout.splitlines() if x.startswith(("v", "step "))],
        "last_checkpoint_match": summary["checkpoints"][-1]["match"],
        "replay_threads": summary["threads"],
        "original_threads": summary["original_threads"],
    }


def repeats(quick: bool) -> dict:
    root = runs_root("determinism_repeats" + ("_quick" if quick else ""))
    sync = sync_repeat_under_load(root, 6 if quick else 20)
    replayed = async_replay(root, 12 if quick else 30, 10)
    print(
        format_table(
            ["check", "result"],
            [
                (
                    f"2 sync runs, {sync['steps']} steps, 2 busy loops: same trajectories",
                    f"{sync['same_trajectories_every_step']} ({sync['shared_trajectories']}/{sync['trajectories']})",
                ),
                ("  same final weights", sync["same_final_weights"]),
                (
                    f"async {replayed['steps']} steps, replayed from v{replayed['from_step']}: last checkpoint",
                    "match" if replayed["last_checkpoint_match"] else "DIFFERS",
                ),
            ],
            title=f"Repeats on {kind_label(cpu_kind())}",
        )
    )
    return {"sync_under_load": sync, "async_replay": replayed}


def _step_and_decode(reps: int) -> dict:
    """In this process: median seconds of a trainer step on the quickstart's tiny model (16 groups of 8
    answers of 20-60 tokens, on all cores) and the engine's tokens/s at batch 64 (one thread)."""
    import os

    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer
    from areal_core.types import Trajectory
    from bench import models

    model, _ = models.build_tiny_model()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    batch = []
    for g in range(16):
        prompt = [rng.randrange(3, vocab) for _ in range(30)]
        for i in range(8):
            n = rng.randrange(20, 60)
            batch.append(
                Trajectory(
                    f"g{g}-{i}",
                    f"g{g}",
                    g * 8 + i,
                    0,
                    prompt,
                    [rng.randrange(3, vocab) for _ in range(n)],
                    [-2.0] * n,
                    [0] * n,
                    finish_reason="stop",
                    reward=rng.choice([-5.0, 5.0]),
                )
            )
    trainer = Trainer(model, TrainerConfig(batch_size=128, max_tokens_per_microbatch=4096), 1.0, 100)
    torch.set_num_threads(os.cpu_count() or 1)
    trainer.step(batch, 0)  # warm-up
    steps = []
    for v in range(reps):
        t0 = time.perf_counter()
        trainer.step(batch, v + 1)
        steps.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    jobs = _jobs(64, min(vocab, 1000), 96, 1, varied=False)
    _generate(model.eval(), jobs[:8], False)
    tps = []
    for _ in range(reps):
        out, s = _generate(model, jobs, False)
        tps.append(sum(len(o.output_ids) for o in out) / s)
    return {"step_s": median(steps), "tokens_per_s": median(tps)}


# the process before and after: MKL as torch leaves it (its first call before areal_core is imported), and
# MKL in the mode areal_core sets
_COST_WORKER = (
    "import json, sys, torch\n"
    "if sys.argv[1] == 'before':\n    torch.ones(2, 2) @ torch.ones(2, 2)\n"
    "from areal_core.numerics import mkl_mode\nfrom bench.determinism import _step_and_decode\n"
    "print(json.dumps({'mkl_mode': mkl_mode(), **_step_and_decode(int(sys.argv[2]))}))"
)


def mkl_mode_cost(pairs: int, reps: int) -> dict:
    """Trainer step time and engine tokens/s with MKL as torch leaves it and in areal_core's strict mode,
    one process each, alternating ``pairs`` times; ratios within each pair."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "MKL_DYNAMIC")}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(pairs):
        for mode in ("before", "after"):
            out = subprocess.run(
                [sys.executable, "-c", _COST_WORKER, mode, str(reps)],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    step_ratio = [a["step_s"] / b["step_s"] for b, a in zip(runs["before"], runs["after"])]
    tps_ratio = [a["tokens_per_s"] / b["tokens_per_s"] for b, a in zip(runs["before"], runs["after"])]
    print(
        format_table(
            ["MKL mode", "trainer step (s)", "engine tokens/s (batch 64)"],
            [
                (
                    runs[m][0]["mkl_mode"],
                    median([r["step_s"] for r in runs[m]]),
                    median([r["tokens_per_s"] for r in runs[m]]),
                )
                for m in ("before", "after")
            ],
            title=f"The cost of MKL's strict mode (tiny model; {pairs} alternating pairs of processes)",
        )
    )
    return {
        "runs": runs,
        "step_after_over_before": spread(step_ratio),
        "tokens_per_s_after_over_before": spread(tps_ratio),
    }


def run(quick: bool) -> dict:
    from bench import models

    torch.set_num_threads(1)
    plan = (
        (("tiny", 16, 64, 2), ("smollm2-135m", 4, 24, 1))
        if quick
        else (("tiny", 64, 96, 3), ("smollm2-135m", 16, 48, 3))
    )
    rows, out = [], {}
    for name, n, new, reps in plan:
        model = models.load(name, torch.float32)
        vocab = min(model.config.vocab_size, 1000)
        res = {
            "default": flips(model, n, new, vocab, False),
            "invariant": flips(model, n, new, vocab, True),
            "cost": cost(model, new, vocab, reps),
        }
        out[name] = res
        for mode in ("default", "invariant"):
            f = res[mode]
            rows.append(
                (
                    name,
                    mode,
                    f["tokens_compared"],
                    f"{f['flipped_requests']}/{f['requests']}",
                    round(f["flips_per_million_tokens"]),
                    f"{f['logprob_mismatch_share']:.3f}",
                    round(res["cost"][f"{mode}_tokens_per_s"]),
                )
            )
        print(
            f"{name}: batch-invariant / default throughput {res['cost']['invariant_over_default']:.3f} "
            f"(spread {res['cost']['ratio_spread']})",
            flush=True,
        )
    print(
        format_table(
            [
                "model",
                "mode",
                "tokens compared",
                "flipped requests",
                "flips / 1M tokens",
                "logprob bits differ (share)",
                "tokens/s (batch 64)",
            ],
            rows,
            title="Seeded answers alone vs in a shrinking batch (float32, one core)",
        )
    )
    rep = repeats(quick)
    mkl = mkl_mode_cost(2 if quick else 4, 3 if quick else 5)
    return {
        "mkl_mode_cost": mkl,
        "cpu_kind": cpu_kind(),
        "models": out,
        "repeats": rep,
        "summary": {f"{m}_invariant_over_default": out[m]["cost"]["invariant_over_default"] for m in out}
        | {f"{m}_default_flips_per_million": out[m]["default"]["flips_per_million_tokens"] for m in out}
        | {
            "sync_repeats_under_load": rep["sync_under_load"]["same_trajectories_every_step"]
            and rep["sync_under_load"]["same_final_weights"],
            "async_replay_matches": rep["async_replay"]["last_checkpoint_match"],
        },
    }
