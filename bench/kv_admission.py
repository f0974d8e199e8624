"""KV-cache-aware admission (``rollout.kv_budget``): a server's memory under a burst, and the
engine's throughput when the budget does not bind.

Model: a random Qwen2 with 4 layers of 8 KV heads x 32 dims in float32, so one position of KV
cache takes 2 x 4 x 8 x 32 x 4 = 8 KiB (compute stays small, the cache is what grows).

* **Memory.** A real server process (``launcher.start_server``) gets a burst of 48 requests
  in one batched ``/generate``: *equal* (32-token prompts, 256 new tokens each: RL's shape,
  one max_new_tokens) and *mixed* (8..63-token prompts, 16..255 new tokens). Budgets of 6, 12
  and 24 equal requests (6 x 288 positions = 13.5 MiB, 27 MiB, 54 MiB; the equal burst reserves
  108 MiB) and none. Measured from outside: the server's RSS after a warm-up request (the fixed
  part: interpreter, torch, model), then its peak RSS during the burst (``VmHWM`` after resetting
  it through ``/proc/PID/clear_refs``). The growth is set against the budget.
* **What the cache allocates.** The same bursts in this process, plus the equal requests arriving
  one every 5 steps (*trickle*), budget 27 MiB or none: the engine's peak KV cache bytes
  (``RolloutEngine.kv_cache_bytes``, K/V of every layer and the mask), read after every step.
* **Throughput when the budget fits.** In this process, one engine unbounded and one with a
  budget equal to the whole workload's reservation (so it is at its limit but never makes a
  request wait): 32 requests, 16..47-token prompts, 128 new tokens; output tokens per second,
  runs interleaved (unbounded, budgeted, ...), the ratio per pair.

One torch thread everywhere, as the rollout server runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import torch

from bench.common import format_table, median, spread, work_dir

KV_HEADS, HEAD_DIM, LAYERS = 8, 32, 4
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
BURST = 48  # requests
BUDGETS = (6 * 288, 12 * 288, 24 * 288)  # positions: 6, 12, 24 requests of the equal burst
MIXED_BUDGET = 12 * 288


def build_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=KV_HEADS * HEAD_DIM,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=256,
        max_position_embeddings=1024,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def burst(kind: str, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) of each request of the ``equal`` or ``mixed`` burst."""
    r = random.Random(seed)
    if kind == "equal":
        return [([r.randrange(4, 256) for _ in range(32)], 256) for _ in range(BURST)]
    return [([r.randrange(4, 256) for _ in range(r.randrange(8, 64))], r.randrange(16, 256)) for _ in range(BURST)]


def fitting_workload(seed: int) -> list[tuple[list[int], int]]:
    r = random.Random(seed)
    return [([r.randrange(4, 256) for _ in range(r.randrange(16, 48))], 128) for _ in range(32)]


def _sampling(max_new: int) -> dict:
    """An answer of exactly ``max_new`` tokens at temperature 1, as the engine takes it (a client
    takes ``Sampling(**_sampling(max_new))``)."""
    return {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True}


# -- memory of a server process ----------------------------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


async def _generate(url: str, jobs: list[tuple[list[int], int]]) -> int:
    from areal_core.rollout.backend import Sampling
    from areal_core.rollout.backends.embedded.client import EmbeddedClient

    client = EmbeddedClient(url, 600.0)
    try:
        out = await client.generate_batch([p for p, _ in jobs], [Sampling(**_sampling(m)) for _, m in jobs])
    finally:
        await client.aclose()
    return sum(len(g.output_ids) for g in out)


def server_memory(folder: str, kind: str, budget: int | None, seed: int, log_dir: str) -> dict:
    """Peak RSS growth of a server over its post-warm-up RSS during one burst."""
    from areal_core.rollout.backends.embedded.launcher import start_server
    from areal_core.rollout.config import EngineConfig, KVBudget

    engine = EngineConfig(max_running=256, kv_budget=None if budget is None else KVBudget(tokens=budget))
    log_path = os.path.join(log_dir, f"server-{kind}-{budget}-{seed}.log")
    jobs = burst(kind, seed)
    with start_server(folder, engine=engine, log_path=log_path) as srv:
        asyncio.run(_generate(srv.url, [([5, 6, 7], 4)]))  # warm-up: torch's first passes
        base = _status_kib(srv.pid, "VmRSS")
        _reset_peak(srv.pid)
        t0 = time.perf_counter()
        tokens = asyncio.run(_generate(srv.url, jobs))
        wall = time.perf_counter() - t0
        peak = _status_kib(srv.pid, "VmHWM")
    reserved = sum(len(p) + m for p, m in jobs)
    return {
        "kind": kind,
        "budget_tokens": budget,
        "seed": seed,
        "base_rss_mib": base / 1024,
        "peak_rss_mib": peak / 1024,
        "growth_mib": (peak - base) / 1024,
        "burst_reservation_mib": reserved * BYTES_PER_TOKEN / 2**20,
        "tokens_per_s": tokens / wall,
    }


# -- in this process ----------------------------------------------------------------------------


def engine_allocation(model, kind: str, budget: int | None, every: int = 0) -> dict:
    """Peak KV cache bytes of an engine over one burst; ``every`` > 0: one request per ``every`` steps."""
    from areal_core.rollout.backends.embedded.engine import RolloutEngine
    from areal_core.rollout.config import KVBudget

    kv_budget = None if budget is None else KVBudget(tokens=budget)
    eng = RolloutEngine(model, max_running=256, start=False, kv_budget=kv_budget)
    jobs, futs, step, peak = burst(kind, 0), [], 0, 0
    while len(futs) < len(jobs) or eng.running or eng.waiting:
        while len(futs) < len(jobs) and (every == 0 or step % every == 0):
            p, m = jobs[len(futs)]
            futs.append(eng.submit(p, _sampling(m)))
            if every:
                break
        eng.step()
        step += 1
        peak = max(peak, eng.kv_cache_bytes)
    assert all(f.done() for f in futs)
    return {
        "kind": kind,
        "arrival": f"one per {every} steps" if every else "burst",
        "budget_tokens": budget,
        "peak_kv_cache_mib": peak / 2**20,
    }


def engine_tokens_per_s(model, jobs, budget: int | None) -> float:
    from areal_core.rollout.backends.embedded.engine import RolloutEngine
    from areal_core.rollout.config import KVBudget

    eng = RolloutEngine(
        model, max_running=256, start=False, seed=0, kv_budget=None if budget is None else KVBudget(tokens=budget)
    )
    t0 = time.perf_counter()
    futs = [eng.submit(p, _sampling(m)) for p, m in jobs]
    while eng.step():
        pass
    wall = time.perf_counter() - t0
    n = sum(len(f.result().output_ids) for f in futs)
    assert n == sum(m for _, m in jobs), n
    return n / wall


def throughput_pairs(reps: int) -> dict:
    model = build_model()
    jobs = fitting_workload(1)
    budget = sum(len(p) + m for p, m in jobs)  # the whole workload at once: at the limit, never waiting
    engine_tokens_per_s(model, jobs[:4], None)  # warm-up
    free, bound = [], []
    for _ in range(reps):
        free.append(engine_tokens_per_s(model, jobs, None))
        bound.append(engine_tokens_per_s(model, jobs, budget))
    ratios = [b / f for b, f in zip(bound, free)]
    return {
        "budget_tokens": budget,
        "unbounded_tok_s": spread(free),
        "budgeted_tok_s": spread(bound),
        "ratio": spread(ratios),
    }


# -- the benchmark -------------------------------------------------------------------------------


def _save_model(log_dir: str) -> str:
    folder = os.path.join(log_dir, "model")
    build_model().save_pretrained(folder)
    return folder


def _mib(tokens: int | None) -> float | None:
    return None if tokens is None else tokens * BYTES_PER_TOKEN / 2**20


def _memory_table(memory: list[dict]) -> str:
    rows = []
    for m in memory:
        budget = _mib(m["budget_tokens"])
        over = None if budget is None else m["growth_mib"] - budget
        rows.append(
            (
                m["kind"],
                "none" if budget is None else budget,
                m["seed"],
                m["base_rss_mib"],
                m["peak_rss_mib"],
                m["growth_mib"],
                over,
                m["burst_reservation_mib"],
                m["tokens_per_s"],
            )
        )
    return format_table(
        [
            "burst",
            "budget MiB",
            "seed",
            "RSS after warm-up",
            "peak RSS",
            "growth",
            "growth - budget",
            "burst reserves",
            "tok/s",
        ],
        rows,
        title=f"server RSS (MiB) under a burst of {BURST} requests ({BYTES_PER_TOKEN} bytes of KV per token)",
    )


def _throughput_table(t: dict) -> str:
    return format_table(
        ["engine", "median tok/s", "min", "max", "n"],
        [
            ("unbounded", *t["unbounded_tok_s"].values()),
            ("budget = workload", *t["budgeted_tok_s"].values()),
            ("ratio budgeted / unbounded", *t["ratio"].values()),
        ],
        title=f"throughput when the budget fits ({t['budget_tokens']} positions, never binding)",
    )


def _allocation_table(rows: list[dict]) -> str:
    return format_table(
        ["requests", "arrival", "budget MiB", "peak KV cache MiB", "over budget"],
        [
            (
                a["kind"],
                a["arrival"],
                _mib(a["budget_tokens"]) or "none",
                a["peak_kv_cache_mib"],
                None if a["budget_tokens"] is None else a["peak_kv_cache_mib"] / _mib(a["budget_tokens"]),
            )
            for a in rows
        ],
        title="what the engine's KV cache allocates (K/V and mask)",
    )


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    mem_reps, tput_reps = (1, 3) if quick else (2, 10)
    log_dir = str(work_dir("kv_admission", quick))
    folder = _save_model(log_dir)
    cases = [("equal", None), *(("equal", b) for b in BUDGETS), ("mixed", None), ("mixed", MIXED_BUDGET)]
    load_before = os.getloadavg()
    memory = [server_memory(folder, kind, budget, seed, log_dir) for seed in range(mem_reps) for kind, budget in cases]
    model = build_model()
    allocation = [
        engine_allocation(model, kind, budget, every)
        for kind, every in (("equal", 0), ("equal", 5), ("mixed", 0))
        for budget in (None, MIXED_BUDGET)
    ]
    tput = throughput_pairs(tput_reps)
    load_after = os.getloadavg()
    print(_memory_table(memory))
    print(_allocation_table(allocation))
    print(_throughput_table(tput))
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")

    def over_budget(kind: str, budget: int) -> float:
        return median(
            [m["growth_mib"] - _mib(budget) for m in memory if m["kind"] == kind and m["budget_tokens"] == budget]
        )

    return {
        "bytes_per_token": BYTES_PER_TOKEN,
        "memory": memory,
        "allocation": allocation,
        "throughput": tput,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "summary": {
            **{f"kv_budget_rss_mib_over_budget_equal_{_mib(b):g}mib": over_budget("equal", b) for b in BUDGETS},
            f"kv_budget_rss_mib_over_budget_mixed_{_mib(MIXED_BUDGET):g}mib": over_budget("mixed", MIXED_BUDGET),
            **{
                f"kv_budget_cache_over_budget_{a['kind']}_{'trickle' if 'per' in a['arrival'] else 'burst'}": a[
                    "peak_kv_cache_mib"
                ]
                / _mib(a["budget_tokens"])
                for a in allocation
                if a["budget_tokens"] is not None
            },
            "kv_budget_fitting_throughput_ratio": tput["ratio"]["median"],
        },
    }
