"""RL against more supervised training for the same wall time, on the quickstart's seeds.

RL's side comes from ``bench/results/quickstart_seeds.json`` (run that first): per seed,
held-out accuracy after RL and RL's wall time (``rl_time_s``: the loop from the first
generated answer to the last step, evaluation excluded). The supervised side starts from
the very model RL started from (the seed's cached warm start, or the same warm start
trained again as the run trains it) and its AdamW state, and goes on with the warm
start where the quickstart stopped it (the same draws and lr schedule), checking
held-out accuracy at the quickstart's check cadence (its evaluation time is not counted),
until RL's time is spent or it has passed RL's final accuracy. Past the warm start's
schedule (``model.warm_start.steps``, lr decaying to 10 %) it goes on at the schedule's
final lr.
Held-out accuracy here is greedy exact match of the reference on the same 500 problems,
which is the chain task's strict grading, read from one teacher-forced pass.

--quick: seed 0 only.
"""

from __future__ import annotations

import json
import os
import time

import torch

from bench.common import RESULTS_DIR, format_table
from bench.learning import CONFIG, mean_std, say


def sft_arm(seed: int, rl: dict) -> dict:
    from areal_core.data.datasets import load_records
    from areal_core.experiment import load_config
    from areal_core.models.loading import load_base_model, warm_start_inputs
    from areal_core.models.warmstart import _encode_pairs, greedy_exact_match, load_optimizer_moments, warm_start
    from areal_core.run.setup import trainer_torch_threads

    cfg = load_config(CONFIG, {"seed": seed})
    train_records, eval_records = load_records(cfg.data)
    # the run's thread count: a warm start not in the cache is trained as the run trained it
    torch.set_num_threads(trainer_torch_threads(cfg, os.cpu_count() or 1))
    info: dict = {}
    model, tokenizer = load_base_model(cfg.model, train_records=train_records, seed=seed, progress=False, info=info)
    stop_step = info["warm_start"]["steps"]
    if stop_step != rl["warm_start_steps"]:
        raise RuntimeError(
            f"seed {seed}: this warm start stopped at step {stop_step}, the RL run's at "
            f"{rl['warm_start_steps']}: they are not the same model"
        )
    held_out = _encode_pairs(tokenizer, [(r.prompt, r.solution) for r in eval_records[: cfg.eval.n_problems]])
    start_acc = greedy_exact_match(model, held_out, tokenizer.pad_token_id)
    pairs, weights, _ = warm_start_inputs(cfg.model, train_records)
    torch.set_num_threads(os.cpu_count() or 1)  # the whole machine, as the RL run had it
    curve: list[tuple[int, float, float]] = [(stop_step, 0.0, start_acc)]  # (step, training seconds, accuracy)
    t_eval = 0.0

    def check(step: int, model) -> bool:
        nonlocal t_eval
        t0 = time.perf_counter()
        acc = greedy_exact_match(model, held_out, tokenizer.pad_token_id)
        spent = t0 - t_start - t_eval
        t_eval += time.perf_counter() - t0
        curve.append((step, spent, acc))
        return spent >= rl["rl_time_s"] or acc > rl["after"]

    ws = cfg.model.warm_start.model_copy(update={"stop_at_accuracy": None})
    moments = load_optimizer_moments(info["warm_start"]["optimizer_moments"])
    t_start = time.perf_counter()
    warm_start(
        model,
        tokenizer,
        pairs,
        ws,
        seed,
        progress=False,
        weights=weights,
        on_check=check,
        resume_at=stop_step,
        moments=moments,
        extra_steps=1_000_000,
    )  # stopped by ``check``
    final = curve[-1]
    passed = next((c for c in curve if c[2] > rl["after"]), None)
    say(
        f"seed {seed}: SFT {start_acc:.3f} -> {final[2]:.3f} after {final[0] - stop_step} more steps "
        f"({final[1]:.0f}s); RL {rl['before']:.3f} -> {rl['after']:.3f} in {rl['rl_time_s']:.0f}s"
    )
    return {
        "seed": seed,
        "sft_start": start_acc,
        "sft_final": final[2],
        "sft_extra_steps": final[0] - stop_step,
        "sft_seconds": final[1],
        "sft_passed_rl_after_s": passed[1] if passed else None,
        "rl_before": rl["before"],
        "rl_after": rl["after"],
        "rl_time_s": rl["rl_time_s"],
        "curve": curve,
    }


def run(quick: bool) -> dict:
    source = RESULTS_DIR / "quickstart_seeds.json"
    if not source.is_file():
        raise FileNotFoundError(f"{source} is missing: run `python -m bench quickstart_seeds` first")
    data = json.loads(source.read_text())
    rl_rows = {r["seed"]: r for r in data["rows"] if r["mode"] == "async"}
    seeds = sorted(rl_rows)[:1] if quick else sorted(rl_rows)
    rows = [sft_arm(s, rl_rows[s]) for s in seeds]
    print(
        format_table(
            [
                "seed",
                "RL before",
                "SFT before",
                "RL after",
                "RL time (s)",
                "SFT after",
                "SFT time (s)",
                "SFT passed RL after (s)",
            ],
            [
                (
                    r["seed"],
                    r["rl_before"],
                    r["sft_start"],
                    r["rl_after"],
                    r["rl_time_s"],
                    r["sft_final"],
                    r["sft_seconds"],
                    r["sft_passed_rl_after_s"] if r["sft_passed_rl_after_s"] is not None else "never",
                )
                for r in rows
            ],
            title="RL vs more supervised warm start, same wall time (held-out accuracy)",
        )
    )
    rl_gain = [r["rl_after"] - r["rl_before"] for r in rows]
    sft_gain = [r["sft_final"] - r["sft_start"] for r in rows]
    summary = {
        "rl_gain_mean": mean_std(rl_gain)[0],
        "sft_gain_mean": mean_std(sft_gain)[0],
        "sft_wins": sum(r["sft_final"] > r["rl_after"] for r in rows),
        "n_seeds": len(rows),
    }
    print(f"SFT ends above RL on {summary['sft_wins']} of {len(rows)} seeds")
    return {"seeds": seeds, "rows": rows, "summary": summary, "quickstart_seeds_from": data.get("finished_at")}
