"""Sampling flips from batch composition, and what the batch-invariant mode costs.

Every request is seeded (keyed sampling: the token at position p drawn from (seed, p)), so two
generations of one request can differ only where the logits differ. For each model: each of N
requests generated alone, and the same requests together in one batch whose members finish at
different lengths (so the batch shrinks under them); a *flip* is a request whose tokens part ways
(counted per million tokens compared up to it), and logprob mismatches count positions whose
logprob differs in any bit. Default mode and batch-invariant mode (``rollout.batch_invariant``)
side by side. Cost: output tokens/s of the engine at batch 64 in both modes, alternating within
each repetition (one core, float32, as a rollout server runs).
"""

from __future__ import annotations

import random
import time

import torch

from bench.common import format_table, median, spread

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
    return {
        "models": out,
        "summary": {f"{m}_invariant_over_default": out[m]["cost"]["invariant_over_default"] for m in out}
        | {f"{m}_default_flips_per_million": out[m]["default"]["flips_per_million_tokens"] for m in out},
    }
