"""Dynamic vs fixed micro-batching: trainer throughput on the same mixed-length batches (paper Fig. 7).

The trainer (``Trainer.step``, the code the system runs) trains the quickstart's tiny
model on batches of B = 128 trajectories whose answer lengths are heavy-tailed. The
same batches go through

* ``dynamic``: first-fit-decreasing under a token budget (``allocate_microbatches``);
* ``fixed (memory-safe)``: the fewest fixed micro-batches (``split_fixed``) that keep
  every micro-batch within the same token budget for ANY batch the sampler can produce,
  i.e. ``ceil(B / floor(budget / max_sequence_length))``: what a fixed-split trainer
  must use to have the dynamic trainer's peak memory. This is the headline baseline;
* ``fixed (32)``: the paper's baseline of 32 fixed micro-batches (reported beside it).

Throughput = tokens (prompt + answer) of the batch / wall time of ``Trainer.step``.
Modes alternate within each repetition, so machine noise hits them alike.
The number of forward passes is compared with the lower bound ceil(total tokens / budget).
"""

from __future__ import annotations

import math
import random

import torch

from bench.common import Timer, format_table, median, progress, ratio, spread

B = 128
N_SAMPLES = 8
BUDGET = 4096
PROMPT_LEN = (6, 26)  # the synthetic task's prompts: `a3b5c7=` with 2..12 terms
MAX_NEW = 480  # tiny's context is 512
PAPER_FIXED = 32


def heavy_tailed_lengths(n: int, rng: random.Random) -> list[int]:
    """Answer lengths with a long tail: lognormal (median ~40 tokens), clipped to [4, MAX_NEW]."""
    return [max(4, min(MAX_NEW, int(rng.lognormvariate(math.log(40), 1.0)))) for _ in range(n)]


def make_batch(rng: random.Random, vocab: int):
    from areal_core.types import Trajectory

    batch = []
    lens = heavy_tailed_lengths(B, rng)
    for g in range(B // N_SAMPLES):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LEN))]
        for s in range(N_SAMPLES):
            i = g * N_SAMPLES + s
            out = [rng.randrange(3, vocab) for _ in range(lens[i])]
            batch.append(Trajectory(
                traj_id=f"b-p{g}-s{s}", group_id=f"p{g}", seq_no=i, admit_version=0, prompt_ids=prompt,
                output_ids=out, output_logprobs=[-1.0] * len(out), output_versions=[0] * len(out),
                finish_reason="stop", reward=float(rng.random() < 0.4) * 10 - 5, correct=None,
            ))
    return batch


def memory_safe_fixed() -> int:
    per_mb = max(1, BUDGET // (PROMPT_LEN[1] + MAX_NEW))
    return math.ceil(B / per_mb)


def make_trainer(model, mode: str, n_fixed: int):
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer

    cfg = TrainerConfig(batch_size=B, microbatching="dynamic" if mode == "dynamic" else "fixed",
                        max_tokens_per_microbatch=BUDGET, n_microbatches=max(1, n_fixed), adv_norm="group",
                        optim={"lr": 1e-6})
    return Trainer(model, cfg, temperature=1.0, total_steps=10_000)


def run(quick: bool) -> dict:
    from bench.models import build_tiny_model

    reps = 2 if quick else 6
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    n_safe = memory_safe_fixed()
    modes = {"dynamic": 0, f"fixed ({n_safe}, memory-safe)": n_safe, f"fixed ({PAPER_FIXED}, paper)": PAPER_FIXED}
    # one model per mode (same init): each trainer's optimizer touches only its own copy
    trainers = {}
    for name, n in modes.items():
        model, tok = build_tiny_model(seed=0)
        trainers[name] = make_trainer(model, "dynamic" if n == 0 else "fixed", n)
    vocab = len(tok)
    batches = [make_batch(rng, vocab) for _ in range(reps)]
    warm = make_batch(random.Random(99), vocab)
    for tr in trainers.values():  # first-call costs (allocator, autograd graph caches) off the clock
        tr.step(warm, 0)

    times: dict[str, list[float]] = {n: [] for n in modes}
    tps: dict[str, list[float]] = {n: [] for n in modes}
    passes: dict[str, list[int]] = {n: [] for n in modes}
    bounds, totals, padded = [], [], {n: [] for n in modes}
    order = list(modes)
    for r, batch in enumerate(progress(batches, desc="dynamic_batching")):
        seqlens = [len(t.prompt_ids) + len(t.output_ids) for t in batch]
        total = sum(seqlens)
        totals.append(total)
        bounds.append(math.ceil(total / BUDGET))
        for name in (order if r % 2 == 0 else order[::-1]):
            tr = trainers[name]
            groups = tr.microbatches(seqlens)
            padded[name].append(sum(len(g) * max(seqlens[i] for i in g) for g in groups))
            with Timer() as t:
                stats = tr.step(batch, 0)
            times[name].append(t.s)
            tps[name].append(total / t.s)
            passes[name].append(stats["forward_passes"])

    dyn = "dynamic"
    safe, paper = order[1], order[2]
    rows = []
    for name in order:
        rows.append((name, median(tps[name]), median(times[name]), median(passes[name]), median(bounds),
                     median(padded[name]) / median(totals), ratio(median(tps[dyn]), median(tps[name]))))
    print(format_table(
        ["micro-batching", "tokens/s", "step s", "fwd passes", "lower bound", "padded/real (attn)", "dynamic gain"],
        rows, title=f"trainer throughput, tiny model, B={B}, budget {BUDGET} tokens, {reps} batches "
                    f"(median tokens/batch {median(totals):.0f})"))
    gain = ratio(median(tps[dyn]), median(tps[safe]))
    return {
        "setup": {"model": "tiny (quickstart shape)", "batch_size": B, "token_budget": BUDGET, "repetitions": reps,
                  "answer_lengths": f"lognormal median 40, sigma 1, clipped to [4, {MAX_NEW}]",
                  "prompt_lengths": list(PROMPT_LEN), "torch_threads": 1,
                  "baseline": f"fixed micro-batches: {n_safe} = memory-safe count for the same budget (headline), "
                              f"and the paper's {PAPER_FIXED}"},
        "modes": {n: {"tokens_per_s": spread(tps[n]), "step_s": spread(times[n]), "forward_passes": passes[n],
                      "padded_tokens_over_real": [p / t for p, t in zip(padded[n], totals)]} for n in order},
        "tokens_per_batch": totals,
        "forward_pass_lower_bound": bounds,
        "summary": {
            "dynamic_batching_gain": gain,
            "dynamic_batching_gain_vs_paper_32_fixed": ratio(median(tps[dyn]), median(tps[paper])),
            "dynamic_forward_passes_over_lower_bound": ratio(sum(passes[dyn]), sum(bounds)),
        },
    }
