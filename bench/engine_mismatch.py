"""Engine-vs-trainer numerics mismatch: rollout servers in bfloat16 beside a float32 trainer.

Large deployments run the rollout engine in bf16 and keep the trainer in fp32 (or compute it with
other kernels), so the behaviour logprobs the engine reports differ from what the trainer computes
for the same weights. The step metric ``logprob_gap_mean`` / ``logprob_gap_max`` measures that gap
apart from staleness (over the tokens sampled at the trainer's own version; docs/RL_TUNING.md).

For each model (the tiny quickstart, SmolLM2-135M-Instruct on its arithmetic task), synchronous
runs (eta 0, so every token counts) of the same seed and steps: servers in the trainer's dtype
(``rollout.dtype: model``), then in bfloat16 (``rollout.dtype: bfloat16``). Reported per run: the
gap's mean and max over the steps, the tokens it covered, the bytes of one weight update and the
training throughput; and what computing the metric costs against a step (its share of the trainer's
step time, timed on a step's worth of tokens).

On a CPU without bf16 units (AVX2 only) bfloat16 is emulated: the bf16 servers generate more
slowly there, so their throughput says nothing about bf16 hardware. The gap is the point.

Full: tiny 20 steps, SmolLM2 4 steps (48 held-out problems; about 25 minutes on 2 cores);
--quick: tiny 3 steps, SmolLM2 1 step.
"""

from __future__ import annotations

import json
import statistics
import time

import pandas as pd
import torch

from bench.common import format_table
from bench.learning import SYNC, runs_root, say, train

MODELS = {
    "tiny": ("configs/quickstart.yaml", 20, 3, ()),
    "smollm2": ("configs/smollm2_quickstart.yaml", 4, 1, ("eval.n_problems=48",)),
}
SERVERS = ("model", "bfloat16")


def metric_cost(tokens: int, step_s: float, reps: int = 20) -> float:
    """Share of a training step of ``step_s`` seconds that ``step_parts.logprob_gap`` takes over
    ``tokens`` tokens (the logprobs it compares exist anyway: the metric adds no forward pass)."""
    from areal_core.trainer.step_parts import logprob_gap

    p, b = torch.randn(tokens), torch.randn(tokens)
    same = torch.rand(tokens) < 0.9
    t0 = time.perf_counter()
    for _ in range(reps):
        logprob_gap(p, b, same)
    return (time.perf_counter() - t0) / reps / step_s


def one(model: str, servers: str, quick: bool, root) -> dict:
    config, full_steps, quick_steps, extra = MODELS[model]
    steps = quick_steps if quick else full_steps
    sets = (*SYNC, f"trainer.max_steps={steps}", f"rollout.dtype={servers}", *extra)
    label = f"{model}-{servers}"
    row = train(label, 0, sets, root, config=config)
    run_dir = root / label
    summary = json.loads((run_dir / "summary.json").read_text())
    m = pd.read_parquet(run_dir / "metrics.parquet")
    step_s = float(m["train_time_s"].median())  # the trainer's forward, backward and update
    tokens = int(m["tokens_trained"].median())
    return {
        "model": model,
        "trainer_dtype": summary["dtype"],
        "servers_dtype": summary["rollout_dtype"],
        "steps": steps,
        "gap_mean": float((m["logprob_gap_sum"].sum()) / m["logprob_gap_tokens_sum"].sum()),
        "gap_mean_per_step": m["logprob_gap_mean"].tolist(),
        "gap_max": float(m["logprob_gap_max"].max()),
        "gap_tokens": int(m["logprob_gap_tokens_sum"].sum()),
        "tokens_trained": int(m["tokens_trained"].sum()),
        "weight_update_bytes": int(m["weight_update_bytes"].median()),
        "tokens_per_s": row["tokens_per_s"],
        "metric_share_of_step": metric_cost(tokens, step_s),
        "accuracy_before": row["before"],
        "run_dir": str(run_dir),
    }


def run(quick: bool = False) -> dict:
    root = runs_root("engine_mismatch" + ("_quick" if quick else ""))
    rows = [one(model, servers, quick, root) for model in MODELS for servers in SERVERS]
    table = format_table(
        ["model", "trainer", "servers", "gap mean (nats)", "gap max", "tokens", "update bytes", "tok/s", "metric cost"],
        [
            (
                r["model"],
                r["trainer_dtype"],
                r["servers_dtype"],
                f"{r['gap_mean']:.2e}",
                f"{r['gap_max']:.3f}",
                r["gap_tokens"],
                f"{r['weight_update_bytes']:,}",
                f"{r['tokens_per_s']:.0f}",
                f"{100 * r['metric_share_of_step']:.4f} %",
            )
            for r in rows
        ],
        title="engine-vs-trainer logprob gap at the behaviour version (synchronous runs, seed 0)",
    )
    print(table, flush=True)
    say(
        "the gap's spread over steps: "
        + "; ".join(f"{r['model']}/{r['servers_dtype']} {statistics.pstdev(r['gap_mean_per_step']):.1e}" for r in rows)
    )
    by = {(r["model"], r["servers_dtype"]): r for r in rows}
    return {
        "rows": rows,
        "summary": {f"logprob_gap_bf16_servers_{model}": by[(model, "bfloat16")]["gap_mean"] for model in MODELS},
    }
