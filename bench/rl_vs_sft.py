"""RL against more supervised training for the same wall time, on the quickstart's seeds.

RL's side comes from ``bench/results/quickstart_seeds.json`` (run that first): per seed,
held-out accuracy after RL and RL's wall time (``rl_time_s``: the loop from the first
generated answer to the last step, evaluation excluded). The supervised side re-runs the
seed's warm start exactly (same data, draws, schedule; the validation checks change
nothing) and keeps training past the point where the quickstart stopped it, checking
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
import time

import torch

from bench.common import RESULTS_DIR, format_table
from bench.learning import CONFIG, mean_std, say

def sft_arm(seed: int, rl: dict) -> dict:
    from areal_core.datasets import load_records
    from areal_core.experiment import load_config
    from areal_core.models.loading import warm_start_inputs
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer
    from areal_core.models.warmstart import _encode_pairs, greedy_exact_match, warm_start

    cfg = load_config(CONFIG, {"seed": seed})
    train_records, eval_records = load_records(cfg.data)
    pairs, weights, val_pairs = warm_start_inputs(cfg.model, train_records)
    tokenizer = build_char_tokenizer()
    held_out = _encode_pairs(tokenizer, [(r.prompt, r.solution) for r in eval_records[: cfg.eval.n_problems]])
    stop_step = rl["warm_start_steps"]
    curve: list[tuple[int, float, float]] = []  # (step, seconds past the quickstart's stop point, accuracy)
    t_stop, t_eval = None, 0.0

    def check(step: int, model) -> bool:
        nonlocal t_stop, t_eval
        if step < stop_step:
            return False
        t0 = time.perf_counter()
        if t_stop is None:
            t_stop = t0
        acc = greedy_exact_match(model, held_out, tokenizer.pad_token_id)
        t_eval += time.perf_counter() - t0
        spent = time.perf_counter() - t_stop - t_eval
        curve.append((step, spent, acc))
        return spent >= rl["rl_time_s"] or acc > rl["after"]

    ws = cfg.model.warm_start.model_copy(update={"stop_at_accuracy": None})
    if stop_step % ws.check_every:
        raise ValueError(f"the quickstart's warm start stopped at step {stop_step}, not a multiple of "
                         f"model.warm_start.check_every ({ws.check_every})")
    model = build_tiny(cfg.model.tiny, tokenizer, seed)
    torch.set_num_threads(2)
    warm_start(model, tokenizer, pairs, ws, seed, progress=False, weights=weights, on_check=check,
               extra_steps=1_000_000)  # stopped by ``check``: RL's time spent
    start_acc, final = curve[0][2], curve[-1]
    passed = next((c for c in curve if c[2] > rl["after"]), None)
    say(f"seed {seed}: SFT {start_acc:.3f} -> {final[2]:.3f} after {final[0] - stop_step} more steps "
        f"({final[1]:.0f}s); RL {rl['before']:.3f} -> {rl['after']:.3f} in {rl['rl_time_s']:.0f}s")
    return {"seed": seed, "sft_start": start_acc, "sft_final": final[2], "sft_extra_steps": final[0] - stop_step,
            "sft_seconds": final[1], "sft_passed_rl_after_s": passed[1] if passed else None,
            "rl_before": rl["before"], "rl_after": rl["after"], "rl_time_s": rl["rl_time_s"], "curve": curve}


def run(quick: bool) -> dict:
    source = RESULTS_DIR / "quickstart_seeds.json"
    if not source.is_file():
        raise FileNotFoundError(f"{source} is missing: run `python -m bench quickstart_seeds` first")
    data = json.loads(source.read_text())
    rl_rows = {r["seed"]: r for r in data["rows"] if r["mode"] == "async"}
    seeds = sorted(rl_rows)[:1] if quick else sorted(rl_rows)
    rows = [sft_arm(s, rl_rows[s]) for s in seeds]
    print(format_table(
        ["seed", "start", "RL after", "RL time (s)", "SFT after", "SFT time (s)", "SFT passed RL after (s)"],
        [(r["seed"], r["rl_before"], r["rl_after"], r["rl_time_s"], r["sft_final"], r["sft_seconds"],
          r["sft_passed_rl_after_s"] if r["sft_passed_rl_after_s"] is not None else "never") for r in rows],
        title="RL vs more supervised warm start, same wall time (held-out accuracy)"))
    rl_gain = [r["rl_after"] - r["rl_before"] for r in rows]
    sft_gain = [r["sft_final"] - r["sft_start"] for r in rows]
    summary = {"rl_gain_mean": mean_std(rl_gain)[0], "sft_gain_mean": mean_std(sft_gain)[0],
               "sft_wins": sum(r["sft_final"] > r["rl_after"] for r in rows), "n_seeds": len(rows)}
    print(f"SFT ends above RL on {summary['sft_wins']} of {len(rows)} seeds")
    return {"seeds": seeds, "rows": rows, "summary": summary, "quickstart_seeds_from": data.get("finished_at")}
