"""Long answers through the embedded engine, by how its KV cache grows: ``python -m bench kv_growth [--quick]``.

SmolLM2-135M-Instruct in the machine's dtype, BATCH answers of NEW tokens each (16-token prompts,
temperature 1, ``ignore_eos``, one torch thread), through a fresh ``RolloutEngine`` as the server
builds it (no KV budget: the cache starts at 256 positions and grows when the longest row outgrows
it). Two ways, interleaved REPS times after a short warm-up of each:

* ``grows by 1.25`` (as it runs where decode attention reads the whole capacity in place, bfloat16
  where oneDNN runs the products): the capacity grows by ``IN_PLACE_WIDENING``, so after the first
  growth every decode step reads the cache in place;
* ``doubles`` (``KVForward.capacity_growth`` set to 2, the rule before): after a growth, attention
  reads in place only once the positions reach 0.8 of the capacity; before that the products copy
  the view of the positions needed, every layer and step.

Per way: the wall seconds of a batch, its tokens/s, the decode steps that read the cache in place,
the capacity at the end; and per repetition the ratio of the two (their spread says how far to
trust it). Where decode attention never reads the capacity in place (float32: a CPU without bf16
units) both ways double and the benchmark says so instead of measuring.

``--quick``: 8 answers of 320 tokens, one repetition: a smoke check.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import format_table, spread
from bench.engine import prompts

BATCH, NEW, REPS = 32, 768, 3
WAYS = {"grows by 1.25": None, "doubles": 2.0}  # way -> KVForward.capacity_growth (None: as it runs)


def run_batch(model, batch: list[list[int]], new: int, growth: float | None) -> dict:
    """One batch of answers through a fresh engine whose cache grows by ``growth`` (None: as it runs)."""
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    eng = RolloutEngine(model, max_running=len(batch), start=False, seed=1)
    kv = eng.kv
    if growth is not None:
        kv.capacity_growth = growth
    decide, in_place, capacity = kv._in_place, [], [0]

    def counted(length: int) -> bool:  # each decode step asks once, after the cache has grown for it
        capacity[0] = kv.capacity  # the engine releases the cache once the batch is done: keep it here
        in_place.append(decide(length))
        return in_place[-1]

    kv._in_place = counted
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": new, "ignore_eos": True}
    try:
        t0 = time.perf_counter()
        futs = eng.submit_many([(p, sp, None) for p in batch])
        while eng.step():
            pass
        for f in futs:
            f.result()
        wall = time.perf_counter() - t0
    finally:
        eng.shutdown()
    return {
        "wall_s": wall,
        "tokens_per_s": len(batch) * new / wall,
        "decode_steps": len(in_place),
        "in_place_steps": sum(in_place),
        "capacity": capacity[0],
    }


def run(quick: bool) -> dict:
    from areal_core.device import resolve_servers_dtype
    from areal_core.rollout.backends.embedded.kv_forward import KVForward
    from areal_core.rollout.backends.embedded.malloc import keep_freed_memory
    from bench import models

    torch.set_num_threads(1)
    keep_freed_memory()  # as the server runs the engine
    batch_size, new, reps = (8, 320, 1) if quick else (BATCH, NEW, REPS)
    dtype = resolve_servers_dtype("auto", torch.device("cpu"))[0]
    model = models.load("smollm2-135m", dtype)
    dt = str(dtype).removeprefix("torch.")
    setup = {"model": "smollm2-135m", "dtype": dt, "batch": batch_size, "new_tokens": new, "repetitions": reps}
    if not KVForward(model, max_slots=1).attend_in_place:
        reason = f"decode attention in {dt} on this CPU never reads the whole capacity in place: both ways double"
        print(f"kv_growth: {reason}")
        return {"setup": setup, "rows": [], "skipped": reason, "summary": {}}
    batch = prompts(batch_size, min(model.config.vocab_size, 1000), batch_size)
    for growth in WAYS.values():
        run_batch(model, batch, 8, growth)  # warm-up: first-call costs off the clock
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for rep in range(reps):
        for w, growth in WAYS.items():
            runs[w].append(run_batch(model, batch, new, growth))
            print(f"  rep {rep + 1}/{reps} {w}: {runs[w][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    rows = [
        {
            "way": w,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[w]),
            "wall_s": statistics.median(r["wall_s"] for r in runs[w]),
            "decode_steps": runs[w][0]["decode_steps"],
            "in_place_steps": runs[w][0]["in_place_steps"],
            "capacity": runs[w][0]["capacity"],
            "runs": runs[w],
        }
        for w in WAYS
    ]
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["grows by 1.25"], runs["doubles"])]
    heads = ["way", "tokens/s", "s a batch", "decode steps in place", "capacity at the end"]
    table = [
        [
            r["way"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['wall_s']:.1f}",
            f"{r['in_place_steps']} of {r['decode_steps']}",
            r["capacity"],
        ]
        for r in rows
    ]
    title = f"SmolLM2-135M-Instruct in {dt}, {batch_size} answers of {new} tokens, one thread"
    print(format_table(heads, table, title=title))
    s = spread(ratios)
    print(
        f"grows by 1.25 over doubles: {statistics.median(ratios):.3f} (per repetition {', '.join(f'{x:.3f}' for x in ratios)})"
    )
    if quick:
        print("note: --quick is a smoke check (8 answers of 320 tokens, one repetition): not a result")
    return {
        "setup": setup,
        "rows": rows,
        "ratios": ratios,
        "summary": {"growth_1_25_over_doubling": statistics.median(ratios), "growth_1_25_over_doubling_spread": s},
    }
