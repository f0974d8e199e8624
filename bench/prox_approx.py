"""pi_prox by recompute vs by AReaL's log-linear approximation: trainer step time at 4 PPO minibatches.

Decoupled PPO with ``trainer.ppo_minibatches > 1`` needs pi_prox (the policy before
the step) for every token. ``trainer.prox_logp: recompute`` runs a no-grad forward
pass over the whole batch first; ``loglinear`` interpolates between the behaviour
and current logprobs by version distance (areal_core/algo/prox.py) and skips that
pass. Both trainers (same initial weights) step on the same batches as the
dynamic-batching benchmark (B = 128, heavy-tailed answers, tokens from versions
0..4 behind), dynamic micro-batching, 1 thread; the modes alternate within each
repetition so machine noise hits them alike. Speed only: the effect on learning
needs full RL runs (>= 2 seeds), not measured here.
"""

from __future__ import annotations

import random
import time

import torch

from bench.common import Timer, format_table, median, progress, ratio, spread
from bench.dynamic_batching import BUDGET, B, make_batch

MINIBATCHES = 4
VERSION = 8
ETA = 4


def stale_versions(batch, rng: random.Random) -> None:
    """Give each trajectory tokens from a run of versions ending 0..ETA behind VERSION (as interrupted
    generation does)."""
    for t in batch:
        first = VERSION - rng.randint(0, ETA)
        cut = rng.randint(0, len(t.output_ids))
        t.output_versions = [first] * cut + [min(VERSION, first + 1)] * (len(t.output_ids) - cut)


def make_trainer(prox_logp: str):
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer
    from bench.models import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    cfg = TrainerConfig(
        batch_size=B,
        ppo_minibatches=MINIBATCHES,
        prox_logp=prox_logp,
        microbatching="dynamic",
        max_tokens_per_microbatch=BUDGET,
        adv_norm="group",
        optim={"lr": 1e-6},
    )
    return Trainer(model, cfg, temperature=1.0, total_steps=10_000)


def run(quick: bool) -> dict:
    from bench.models import build_tiny_model

    reps = 3 if quick else 8
    torch.set_num_threads(1)
    rng = random.Random(0)
    vocab = len(build_tiny_model(seed=0)[1])
    batches = [make_batch(rng, vocab) for _ in range(reps)]
    for b in batches:
        stale_versions(b, rng)
    modes = ("recompute", "loglinear")
    trainers = {m: make_trainer(m) for m in modes}
    warm = make_batch(random.Random(99), vocab)
    for tr in trainers.values():
        tr.step(warm, VERSION)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}  # this thread's CPU seconds: less hit by other load than wall time
    passes = {m: [] for m in modes}
    for r, batch in enumerate(progress(batches, desc="prox_approx")):
        for m in modes if r % 2 == 0 else modes[::-1]:
            with Timer() as t:
                c0 = time.thread_time()
                stats = trainers[m].step(batch, VERSION)
                cpu[m].append(time.thread_time() - c0)
            assert stats["prox_logp_path"] == m, stats["prox_logp_path"]
            times[m].append(t.s)
            passes[m].append(stats["prox_forward_passes"] + stats["forward_passes"])
    speedups = [a / b for a, b in zip(times["recompute"], times["loglinear"])]
    cpu_speedups = [a / b for a, b in zip(cpu["recompute"], cpu["loglinear"])]
    rows = [
        (
            m,
            median(times[m]),
            min(times[m]),
            max(times[m]),
            median(cpu[m]),
            median(passes[m]),
            ratio(median(times["recompute"]), median(times[m])),
            ratio(median(cpu["recompute"]), median(cpu[m])),
        )
        for m in modes
    ]
    print(
        format_table(
            ["prox_logp", "step s (median)", "min", "max", "cpu s", "forward passes", "speedup", "speedup (cpu)"],
            rows,
            title=f"trainer step, tiny model, B={B}, ppo_minibatches={MINIBATCHES}, {reps} batches; "
            f"per-batch speedup wall {min(speedups):.2f}..{max(speedups):.2f}, "
            f"cpu {min(cpu_speedups):.2f}..{max(cpu_speedups):.2f}",
        )
    )
    return {
        "setup": {
            "model": "tiny (quickstart shape)",
            "batch_size": B,
            "ppo_minibatches": MINIBATCHES,
            "token_budget": BUDGET,
            "repetitions": reps,
            "torch_threads": 1,
            "token_versions": f"runs of versions 0..{ETA} behind the trainer's {VERSION}",
        },
        "modes": {
            m: {"step_s": spread(times[m]), "step_cpu_s": spread(cpu[m]), "forward_passes": passes[m]} for m in modes
        },
        "per_batch_speedup": {"wall": speedups, "cpu": cpu_speedups},
        "summary": {"prox_loglinear_speedup": median(speedups), "prox_loglinear_speedup_cpu": median(cpu_speedups)},
    }
