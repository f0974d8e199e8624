"""Where the embedded engine's decode step goes: ``python -m bench decode_parts [--quick]``.

SmolLM2-135M-Instruct at batch 64 (16-token prompts, NEW new tokens each (32), temperature 1, one torch
thread, as ``bench engine`` runs it), in float32 and, where the CPU has bfloat16 units, in bfloat16,
each as the engine runs it and with one of its parts as it was before, the ways interleaved batch by
batch so the table shows each part before and after:

* ``as it runs``: decode attention the way the engine takes it in that dtype on this CPU
  (``fused_decode_attention``: one fused flash-attention call, except in bfloat16 on a CPU: three
  calls), and in bfloat16 the products' weights packed once for oneDNN
  (``embedded/onednn.py``); its label says which attention;
* ``three-call attention`` or ``fused attention``, whichever the engine does not take: decode
  attention as a score product, a softmax and a value product, or as one flash-attention call
  (``KVForward.fused_attention`` switched);
* ``F.linear products`` (bfloat16): plain ``F.linear`` products (``KVForward.packed`` turned off);
* ``module norms`` (bfloat16, where the norms are not folded into the products): each RMSNorm
  run by the model's own module instead of one fused ``F.rms_norm`` call;
* ``keys-first scores`` (bfloat16, where the engine takes three-call attention): the score product
  as keys . q^T over the cache's view, where the engine computes q . keys^T over a copy of the keys
  (``KVForward.query_first_scores`` switched off);
* ``needed positions only`` (bfloat16, where oneDNN runs the products): decode attention over the
  positions the longest row needs, a view the products copy, where the engine reads the whole
  capacity in place when it is at most 1.25 times those (``KVForward.attend_in_place`` switched off).

The engine is driven step by step; its parts are timed by wrapping them in place (a
``perf_counter`` pair a call: about 0.1 % of a step), on decode steps only:

* ``norms``: the RMSNorms before attention and MLP of every layer, and the final one;
* ``projections``: the fused QKV projection, RoPE, the KV write and the embedding (the rest of the
  layer loop once the other parts are taken out);
* ``attention``: scores, softmax and the weighted sum over the cache;
* ``output projection``; ``MLP`` (gate-up, activation, down; its norm under norms);
* ``LM head``: the vocabulary projection to float32 logits (the final norm under norms);
* ``sampling``: the draw and the behaviour logprob over the vocabulary;
* ``bookkeeping``: the rest of the step: each sequence's token, logprob and version recorded,
  finished ones retired, queued commands and updates looked at (Python).

Each part's milliseconds a decode step and its share, medians over REPS batches (the first, a
warm-up, left out); and the one-thread matmul rate of each dtype (``bench.engine.matmul_flops``),
which says how fast this CPU's matrix units are.

Then decode attention at a long context, where its share of a step is largest: BATCH rows holding
LONG_CONTEXT cached positions each (random prompt tokens, prefilled once), LONG_STEPS decode steps of
the forward alone (no sampling) from there, per way of taking attention (as it runs, the other call
style, and where the engine takes three calls in bfloat16 the keys-first scores and, where oneDNN
runs the products, the needed positions only), interleaved REPS
times over the same cache; the milliseconds a step of the forward and of attention in it, medians.
This in the machine's dtype only (bfloat16 where the CPU has bf16 units, else float32).

``--quick``: 16 new tokens, two batches, a context of 128: a smoke check.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict

import torch

from areal_core.rollout.backends.embedded import onednn
from areal_core.rollout.backends.embedded.kv_forward import fused_decode_attention
from bench.common import format_table
from bench.engine import PROMPT, matmul_flops, prompts

BATCH, NEW, REPS = 64, 32, 5
LONG_CONTEXT, LONG_STEPS = 512, 16
# KVForward's decode attention methods, each timed as attention (the last calls _attention, but only
# in batch-invariant mode, which these benchmarks do not run)
ATTENTION_CALLS = ("_fused_attention", "_attention", "_merged_attention", "_attention_by_head_chunks")
PARTS = ("projections", "attention", "output projection", "MLP", "norms", "LM head", "sampling", "bookkeeping")


class PartClock:
    """Seconds spent in wrapped calls, by name, counted while ``on``."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.on = False
        self.steps = 0

    def wrap(self, obj, attr: str, name: str) -> None:
        """Time every call of ``obj.attr`` as ``name`` (an instance attribute shadows the method)."""
        inner = getattr(obj, attr)

        def timed(*args, **kw):
            if not self.on:
                return inner(*args, **kw)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.s[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)


def instrument(engine, clock: PartClock) -> None:
    """Wrap the engine's parts (see the module docstring); ``clock`` counts on decode steps only."""
    kv = engine.kv
    for f in kv.fused:
        clock.wrap(f, "norm1", "norm1")
        clock.wrap(f, "norm2", "norm2")
    clock.wrap(kv, "_final_norm", "final norm")
    for name in ATTENTION_CALLS:
        clock.wrap(kv, name, "attention")
    clock.wrap(kv, "_out_proj", "output projection")
    clock.wrap(kv, "_mlp", "MLP with its norm")
    clock.wrap(kv, "_logits", "LM head with the final norm")
    clock.wrap(kv, "decode", "forward")
    clock.wrap(engine, "_record", "record")
    clock.wrap(engine, "_decode_step", "decode step")
    inner_decode_step, inner_step = engine._decode_step, engine.step

    def decode_step():
        clock.on = True
        clock.steps += 1
        inner_decode_step()

    def step():
        t0 = time.perf_counter()
        try:
            return inner_step()
        finally:
            if clock.on:  # (a decode step turned it on)
                clock.s["step"] += time.perf_counter() - t0
            clock.on = False

    engine._decode_step, engine.step = decode_step, step


def parts_of(s: dict[str, float]) -> dict[str, float]:
    """The module docstring's parts from the wrapped calls' totals ``s`` (nested ones taken apart)."""
    out = {
        "norms": s["norm1"] + s["norm2"] + s["final norm"],
        "attention": s["attention"],
        "output projection": s["output projection"],
        "MLP": s["MLP with its norm"] - s["norm2"],
        "LM head": s["LM head with the final norm"] - s["final norm"],
    }
    inside = s["norm1"] + s["attention"] + s["output projection"] + s["MLP with its norm"]
    out["projections"] = s["forward"] - inside - s["LM head with the final norm"]
    out["sampling"] = s["decode step"] - s["forward"] - s["record"]
    out["bookkeeping"] = s["step"] - s["decode step"] + s["record"]
    return out


WAYS = (
    "as it runs",
    "fused attention",
    "three-call attention",
    "F.linear products",
    "module norms",
    "keys-first scores",
    "needed positions only",
)


def run_batch(model, batch: list[list[int]], new: int, way: str = "as it runs") -> dict[str, float]:
    """One batch through a fresh engine run one of the ``WAYS``: each part's seconds per decode step,
    and ``total``."""
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    eng = RolloutEngine(
        model, max_running=len(batch), start=False, kv_slots=len(batch), kv_capacity=PROMPT + new + 1, seed=1
    )
    take_way(eng.kv, way)
    clock = PartClock()
    try:
        instrument(eng, clock)
        sp = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": new, "ignore_eos": True}
        futs = eng.submit_many([(p, sp, None) for p in batch])
        while eng.step():
            pass
        for f in futs:
            f.result()
    finally:
        eng.shutdown()
    per_step = {k: v / clock.steps for k, v in parts_of(clock.s).items()}
    return {**per_step, "total": clock.s["step"] / clock.steps}


def take_way(kv, way: str) -> None:
    """Switch a fresh ``KVForward`` from how it runs to ``way`` (one of ``WAYS``)."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    if way == "F.linear products" and kv.packed:
        kv.packed = False
        kv.weights_changed()
    if way.endswith(" attention"):
        kv.fused_attention = way == "fused attention"
    if way == "module norms":
        for f, layer in zip(kv.fused, kv.layers):
            f.norm1, f.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        kv._final_norm = kv.norm
    if way == "keys-first scores":
        kv.query_first_scores = False
    if way == "needed positions only":
        kv.attend_in_place = False


def attention_ways(dtype: torch.dtype) -> tuple[str, list[str]]:
    """The engine's decode attention in ``dtype`` on this CPU and the attention ways to set beside it."""
    three = not fused_decode_attention(dtype, torch.device("cpu"))
    engine_attention = "three-call attention" if three else "fused attention"
    other = "fused attention" if three else "three-call attention"
    bf16_three = three and dtype == torch.bfloat16
    in_place = bf16_three and onednn.packable(dtype, torch.device("cpu"))
    return engine_attention, [other] + (["keys-first scores"] if bf16_three else []) + (
        ["needed positions only"] if in_place else []
    )


def long_context(name: str, dtype: torch.dtype, positions: int, reps: int) -> list[dict]:
    """Decode attention at a long context (the module docstring): per way, the forward's and its
    attention's milliseconds a decode step, medians over ``reps`` interleaved passes."""
    from areal_core.rollout.backends.embedded.kv_forward import KVForward
    from bench import models

    model = models.load(name, dtype)
    engine_attention, others = attention_ways(dtype)
    ways = ["as it runs", *others]
    r = random.Random(BATCH)
    prompt_rows = [[r.randrange(3, min(model.config.vocab_size, 1000)) for _ in range(positions)] for _ in range(BATCH)]
    length = positions + LONG_STEPS + 1
    kv = KVForward(model, max_slots=BATCH, init_slots=BATCH, init_capacity=length)
    kv.ensure(BATCH, length)
    for i in range(0, BATCH, 8):
        kv.prefill(list(range(i, i + 8)), prompt_rows[i : i + 8])
    as_it_runs = (kv.fused_attention, kv.query_first_scores, kv.attend_in_place)
    clock = PartClock()
    for attr in ATTENTION_CALLS:
        clock.wrap(kv, attr, "attention")
    clock.on = True
    tokens = torch.tensor([p[0] for p in prompt_rows])

    def steps(way: str) -> tuple[float, float]:
        kv.fused_attention, kv.query_first_scores, kv.attend_in_place = as_it_runs
        if way != "as it runs":
            take_way(kv, way)  # (attention ways only: switches, the cache stays)
        clock.s.clear()
        lengths = torch.full((BATCH,), positions)
        t0 = time.perf_counter()
        for k in range(LONG_STEPS):
            kv.decode(tokens, lengths, positions + k + 1)
            lengths += 1
        return (time.perf_counter() - t0) / LONG_STEPS, clock.s["attention"] / LONG_STEPS

    for w in ways:
        steps(w)  # warm-up
    runs: dict[str, list] = {w: [] for w in ways}
    for _ in range(reps):
        for w in ways:
            runs[w].append(steps(w))
    dt = str(dtype).removeprefix("torch.")
    return [
        {
            "dtype": dt,
            "way": w,
            "label": f"{dt}, {w}" + (f" ({engine_attention})" if w == "as it runs" else ""),
            "positions": positions,
            "batch": BATCH,
            "decode_steps": LONG_STEPS,
            "forward_ms": 1000 * statistics.median(r[0] for r in runs[w]),
            "attention_ms": 1000 * statistics.median(r[1] for r in runs[w]),
            "runs_forward_ms": [1000 * r[0] for r in runs[w]],
        }
        for w in ways
    ]


def measure(name: str, dtype: torch.dtype, new: int, reps: int) -> list[dict]:
    """Medians over ``reps`` batches (after one warm-up) of each part's milliseconds per decode step: a
    row for the engine as it runs and one for each part as it was (``WAYS``; the F.linear products
    only where the engine packs its weights), the ways interleaved."""
    from bench import models

    model = models.load(name, dtype)
    batch = prompts(BATCH, min(model.config.vocab_size, 1000), BATCH)
    cpu = torch.device("cpu")
    engine_attention, attention_others = attention_ways(dtype)
    other = attention_others[0]
    ways = ["as it runs", other] + (["F.linear products"] if onednn.packable(dtype, cpu) else [])
    ways += ["module norms"] if dtype != torch.float32 else []  # (float32: folded into the products)
    ways += attention_others[1:]
    for w in ways:
        run_batch(model, batch, 4, w)  # warm-up: first-call costs off the clock
    runs: dict[str, list] = {w: [] for w in ways}
    for _ in range(reps):
        for w in ways:
            runs[w].append(run_batch(model, batch, new, w))
    rows = []
    for w in ways:
        ms = {k: 1000 * statistics.median(r[k] for r in runs[w]) for k in (*PARTS, "total")}
        dt = str(dtype).removeprefix("torch.")
        rows.append(
            {
                "model": name,
                "dtype": dt,
                "way": w,
                "as_it_runs": w == "as it runs",
                "attention": engine_attention if w != other else other,
                "label": f"{dt}, {w}" + (f" ({engine_attention})" if w == "as it runs" else ""),
                "batch": BATCH,
                "new_tokens": new,
                "ms_per_step": ms,
                "share": {k: ms[k] / ms["total"] for k in PARTS},
                "runs_ms_total": [1000 * r["total"] for r in runs[w]],
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    heads = ["part"] + [f"{r['label']} ms" for r in rows] + [f"{r['label']} share" for r in rows]
    table = [
        [p] + [f"{r['ms_per_step'][p]:.2f}" for r in rows] + [f"{100 * r['share'][p]:.1f} %" for r in rows]
        for p in PARTS
    ]
    table.append(["decode step"] + [f"{r['ms_per_step']['total']:.2f}" for r in rows] + ["100 %" for _ in rows])
    print(format_table(heads, table, title=f"SmolLM2-135M-Instruct decode step at batch {BATCH}, one thread"))


def print_long_rows(rows: list[dict]) -> None:
    heads = ["way", "forward ms a step", "attention ms a step", "attention share"]
    table = [
        [
            r["label"],
            f"{r['forward_ms']:.1f}",
            f"{r['attention_ms']:.1f}",
            f"{100 * r['attention_ms'] / r['forward_ms']:.0f} %",
        ]
        for r in rows
    ]
    r0 = rows[0]
    title = f"decode at {r0['positions']} cached positions, batch {r0['batch']}, one thread (forward only)"
    print(format_table(heads, table, title=title))


def run(quick: bool) -> dict:
    from areal_core.device import cpu_bf16_units
    from areal_core.rollout.backends.embedded.malloc import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # as the server runs the engine (and bench engine measures it)
    new, reps, context = (16, 2, 128) if quick else (NEW, REPS, LONG_CONTEXT)
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_bf16_units() else [])
    rows = []
    for d in dtypes:
        rate = matmul_flops(d) / 1e9
        rows += [{**row, "matmul_gflops_one_thread": rate} for row in measure("smollm2-135m", d, new, reps)]
    print_rows(rows)
    long_rows = long_context("smollm2-135m", dtypes[-1], context, reps)
    print_long_rows(long_rows)
    if quick:
        print("note: --quick is a smoke check (16 tokens, two batches, a context of 128): not a result")
    summary = {
        f"decode_step_ms_smollm2_{r['dtype']}"
        + ("" if r["as_it_runs"] else "_" + r["way"].replace(" ", "_").replace(".", "")): r["ms_per_step"]["total"]
        for r in rows
    }
    for r in long_rows:
        summary[f"long_context_forward_ms_{r['dtype']}_{r['way'].replace(' ', '_')}"] = r["forward_ms"]
    return {"rows": rows, "long_context": long_rows, "summary": summary}
