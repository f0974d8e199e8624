"""Dynamic vs fixed micro-batching: trainer throughput on the same mixed-length batches (paper Fig. 7).

The trainer (``Trainer.step``, the code the system runs) trains the quickstart's tiny
model on batches of B = 128 trajectories whose answer lengths are heavy-tailed. The
same batches go through

* ``dynamic``: first-fit-decreasing under a token budget (``allocate_microbatches``);
* ``fixed (memory-safe)``: the fewest fixed micro-batches (``split_fixed``) that keep
  every micro-batch within the same token budget for ANY batch the sampler can produce,
  i.e. ``ceil(B / floor(budget / max_sequence_length))``: what a fixed-split trainer
  must use to have the dynamic trainer's peak memory. This is the headline baseline;
* ``fixed (32)``: the paper's baseline of 32 fixed micro-batches (reported beside it);
* ``dynamic, padded attention``: dynamic micro-batches with the trainer's earlier attention
  (each micro-batch right-padded to its longest sequence), to show what per-sequence
  attention gives the system path.

A second table times the attention options alone (forward + backward) on the dynamic
micro-batches of the first batch (bench/attention_options.py).

Throughput = tokens (prompt + answer) of the batch / wall time of ``Trainer.step``.
Modes alternate within each repetition, so machine noise hits them alike.
The number of forward passes is compared with the lower bound ceil(total tokens / budget).
"""

from __future__ import annotations

import contextlib
import math
import random
import time

import torch

from bench.attention_options import OPTIONS, padded, time_forward_backward, trainer_attention
from bench.common import Timer, format_table, median, progress, ratio, spread, synthetic_answer

B = 128
N_SAMPLES = 8
BUDGET = 4096
PROMPT_LEN = (6, 26)  # the synthetic task's prompts: `a3b5c7=` with 2..12 terms
MAX_NEW = 480  # tiny's context is 512
PAPER_FIXED = 32
PADDED = "dynamic, padded attention (before)"


def heavy_tailed_lengths(n: int, rng: random.Random) -> list[int]:
    """Answer lengths with a long tail: lognormal (median ~40 tokens), clipped to [4, MAX_NEW]."""
    return [max(4, min(MAX_NEW, int(rng.lognormvariate(math.log(40), 1.0)))) for _ in range(n)]


def make_batch(rng: random.Random, vocab: int):
    batch = []
    lens = heavy_tailed_lengths(B, rng)
    for g in range(B // N_SAMPLES):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LEN))]
        for s in range(N_SAMPLES):
            i = g * N_SAMPLES + s
            out = [rng.randrange(3, vocab) for _ in range(lens[i])]
            reward = float(rng.random() < 0.4) * 10 - 5
            batch.append(synthetic_answer(f"b-p{g}-s{s}", f"p{g}", i, prompt, out, reward))
    return batch


def memory_safe_fixed() -> int:
    per_mb = max(1, BUDGET // (PROMPT_LEN[1] + MAX_NEW))
    return math.ceil(B / per_mb)


def make_trainer(model, mode: str, n_fixed: int):
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer

    cfg = TrainerConfig(
        batch_size=B,
        microbatching="dynamic" if mode == "dynamic" else "fixed",
        max_tokens_per_microbatch=BUDGET,
        n_microbatches=max(1, n_fixed),
        adv_norm="group",
        optim={"lr": 1e-6},
    )
    return Trainer(model, cfg, temperature=1.0, total_steps=10_000)


def run(quick: bool) -> dict:
    from bench.models import build_tiny_model

    reps = 2 if quick else 6
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    n_safe = memory_safe_fixed()
    modes = {
        "dynamic": 0,
        f"fixed ({n_safe}, memory-safe)": n_safe,
        f"fixed ({PAPER_FIXED}, paper)": PAPER_FIXED,
        PADDED: 0,
    }
    # one model per mode (same init): each trainer's optimizer touches only its own copy
    trainers = {}
    for name, n in modes.items():
        model, tok = build_tiny_model(seed=0)
        trainers[name] = make_trainer(model, "dynamic" if n == 0 else "fixed", n)
    vocab = len(tok)
    batches = [make_batch(rng, vocab) for _ in range(reps)]
    warm = make_batch(random.Random(99), vocab)
    for name, tr in trainers.items():  # first-call costs (allocator, autograd graph caches) off the clock
        with attention_for(name):
            tr.step(warm, 0)

    times: dict[str, list[float]] = {n: [] for n in modes}
    cpu: dict[str, list[float]] = {n: [] for n in modes}  # this thread's CPU seconds: less hit by other load
    tps: dict[str, list[float]] = {n: [] for n in modes}
    passes: dict[str, list[int]] = {n: [] for n in modes}
    bounds, totals, attn_slots = [], [], {n: [] for n in modes}
    order = list(modes)
    for r, batch in enumerate(progress(batches, desc="dynamic_batching")):
        seqlens = [len(t.prompt_ids) + len(t.output_ids) for t in batch]
        total = sum(seqlens)
        totals.append(total)
        bounds.append(math.ceil(total / BUDGET))
        for name in order if r % 2 == 0 else order[::-1]:
            tr = trainers[name]
            groups = tr.microbatches([t.prompt_ids for t in batch], [len(t.output_ids) for t in batch])
            # attention positions computed: the padded [n, L_max] view, or the real tokens (per-sequence)
            attn_slots[name].append(
                sum(len(g) * max(seqlens[i] for i in g) for g in groups) if name == PADDED else total
            )
            with attention_for(name), Timer() as t:
                c0 = time.thread_time()
                stats = tr.step(batch, 0).metrics
                cpu[name].append(time.thread_time() - c0)
            times[name].append(t.s)
            tps[name].append(total / t.s)
            passes[name].append(stats["forward_passes"])

    dyn = "dynamic"
    safe, paper = order[1], order[2]
    attention = attention_table(batches[0], reps, quick)
    rows = []
    for name in order:
        rows.append(
            (
                name,
                median(tps[name]),
                median(times[name]),
                median(cpu[name]),
                median(passes[name]),
                median(bounds),
                median(attn_slots[name]) / median(totals),
                ratio(median(tps[dyn]), median(tps[name])),
                spread(paired(cpu, name, dyn))["median"],
            )
        )
    print(
        format_table(
            [
                "micro-batching",
                "tokens/s",
                "step s",
                "cpu s",
                "fwd passes",
                "lower bound",
                "attn slots/real",
                "dynamic gain",
                "gain (cpu, paired)",
            ],
            rows,
            title=f"trainer throughput, tiny model, B={B}, budget {BUDGET} tokens, {reps} batches "
            f"(median tokens/batch {median(totals):.0f})",
        )
    )
    gain = ratio(median(tps[dyn]), median(tps[safe]))
    return {
        "setup": {
            "model": "tiny (quickstart shape)",
            "batch_size": B,
            "token_budget": BUDGET,
            "repetitions": reps,
            "answer_lengths": f"lognormal median 40, sigma 1, clipped to [4, {MAX_NEW}]",
            "prompt_lengths": list(PROMPT_LEN),
            "torch_threads": 1,
            "baseline": f"fixed micro-batches: {n_safe} = memory-safe count for the same budget (headline), "
            f"and the paper's {PAPER_FIXED}",
        },
        "modes": {
            n: {
                "tokens_per_s": spread(tps[n]),
                "step_s": spread(times[n]),
                "step_cpu_s": spread(cpu[n]),
                "forward_passes": passes[n],
                "attention_slots_over_real_tokens": [p / t for p, t in zip(attn_slots[n], totals)],
            }
            for n in order
        },
        "tokens_per_batch": totals,
        "attention_forward_backward_cpu_s": attention,
        "paired_cpu_ratios": {
            "dynamic_batching_gain": spread(paired(cpu, safe, dyn)),
            "per_sequence_attention_step_speedup": spread(paired(cpu, PADDED, dyn)),
        },
        "forward_pass_lower_bound": bounds,
        "summary": {
            "dynamic_batching_gain": gain,
            "dynamic_batching_gain_vs_paper_32_fixed": ratio(median(tps[dyn]), median(tps[paper])),
            "dynamic_batching_gain_cpu": median(paired(cpu, safe, dyn)),
            "per_sequence_attention_step_speedup": ratio(median(tps[dyn]), median(tps[PADDED])),
            "per_sequence_attention_step_speedup_cpu": median(paired(cpu, PADDED, dyn)),
            "dynamic_forward_passes_over_lower_bound": ratio(sum(passes[dyn]), sum(bounds)),
        },
    }


def paired(seconds: dict[str, list[float]], slow: str, fast: str) -> list[float]:
    """Per batch: seconds of mode ``slow`` over seconds of mode ``fast`` on the same batch."""
    return [a / b for a, b in zip(seconds[slow], seconds[fast])]


def attention_for(mode: str):
    """The padded-attention row runs the trainer with the earlier attention; the others with its own."""
    return trainer_attention(padded) if mode == PADDED else contextlib.nullcontext()


def attention_table(batch, reps: int, quick: bool) -> dict:
    """Forward + backward seconds of each attention option over the batch's dynamic micro-batches
    (tiny model's heads: 4 query, 2 key/value, head dim 32); the block-diagonal mask in full runs only."""
    from areal_core.algo import allocate_microbatches

    seqlens = [len(t.prompt_ids) + len(t.output_ids) for t in batch]
    mbs = [[seqlens[i] for i in g] for g in allocate_microbatches(seqlens, BUDGET)]
    check_options_agree(mbs[-1])
    times = {}
    for name, fn in OPTIONS.items():
        if quick and "mask" in name:
            continue
        n = 1 if "mask" in name else reps
        times[name] = spread([time_forward_backward(fn, mbs, 4, 2, 32) for _ in range(n)])
    best = times["per-sequence fused (trainer)"]["median"]
    print(
        format_table(
            ["attention (fwd + bwd)", "cpu s (median)", "min", "max", "n", "x trainer's"],
            [(k, v["median"], v["min"], v["max"], v["n"], v["median"] / best) for k, v in times.items()],
            title=f"attention alone on {len(mbs)} dynamic micro-batches ({sum(map(len, mbs))} sequences)",
        )
    )
    return times


def check_options_agree(lens: list[int]) -> None:
    """Every option computes the same attention (else its timing would mean nothing)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), h, 32, generator=g) for h in (4, 2, 2))
    ref = OPTIONS["per-sequence fused (trainer)"](q, k, v, lens, 0.2)
    for name, fn in OPTIONS.items():
        torch.testing.assert_close(fn(q, k, v, lens, 0.2), ref, atol=1e-5, rtol=1e-4, msg=name)
