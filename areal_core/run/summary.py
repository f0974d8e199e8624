"""A run's summary: what ``summary.json`` holds (:class:`RunSummary`), how it is computed from the run
(:func:`build_summary`), and its one rendering for people (:func:`summary_rows`), which both the
terminal (``areal-flow train``) and the Prefect UI's result artifact show."""

from __future__ import annotations

import math
import time
from typing import TypedDict

import torch

from areal_core.experiment import ExperimentConfig
from areal_core.rollout.weight_layout import dtype_name
from areal_core.run.costs import describe as cost_line
from areal_core.run.costs import summary as cost_summary
from areal_core.run.loop import LoopResult
from areal_core.run.metrics import RunLog, check_ledger


class Percentiles(TypedDict):
    p50: float
    p90: float
    max: int


class RunSummary(TypedDict, total=False):
    """``summary.json``: one run's result (``multi_agent`` only where the run had agents)."""

    name: str
    code: dict  # the commit the run ran (run/folder.py code_version)
    accuracy_before: float  # held-out greedy accuracy (eval.n_problems problems) before RL
    accuracy_after: float
    # the share of held-out answers that state an answer in a form the grader reads (its format: a
    # boxed answer, "#### N", "the answer is N", a chain's "|N"), right or wrong: format apart from
    # accuracy (code: every answer counts, its text being the program where it has no fenced block)
    answered_before: float
    answered_after: float
    n_eval_problems: int
    steps: int
    final_version: int
    eta: int
    objective: str
    trainer_backend: str
    dtype: str  # what the trainer computes in
    rollout_dtype: str  # what the servers compute in (rollout.dtype)
    weight_update: str
    trainer_torch_threads: int
    weight_transport: str
    microbatching: str
    max_staleness_observed: int
    effective_train_tokens_per_s: float  # trained tokens / RL time, after this process's warm-up steps
    throughput_steps: int  # the steps that figure rests on
    tokens_trained: int
    resumed_from_step: int | None
    warm_start: dict | None  # the tiny model's supervised warm start: steps, val_accuracy, wall_s, cached
    rollout_resubmits: int
    # the trainable pool's changes (elastic pools): servers that left (died) and joined, by URL, and the
    # tokens dead servers had generated that their answers kept (continued elsewhere from there)
    rollout_pool: dict
    grading_resubmits: int
    grading_tasks: int
    grading_timeouts: int
    grading_failures: int  # answers graded wrong because grading itself failed (a worker lost, an error)
    rl_time_s: float
    reward_wait_s: float  # the trainer's wait for grades alone (NaN: multi-turn, not measured)
    reward_wait_share: float  # of the RL time
    wall_time_s: float
    answer_length_before: Percentiles
    answer_length_after: Percentiles
    trained_answer_length: Percentiles
    ledger_check: dict  # exactly once, and no trained token staler than eta (metrics.check_ledger)
    checkpoints: str  # the checkpoint store's URL
    checkpoint_writes: list[dict]
    checkpoint_bytes_per_step: float
    multi_agent: dict
    cost: dict  # the cost ledger's totals (costs.py)


def percentiles(xs: list[int]) -> Percentiles:
    t = torch.tensor(xs, dtype=torch.float32)
    return {"p50": float(t.quantile(0.5)), "p90": float(t.quantile(0.9)), "max": int(t.max())}


def build_summary(
    cfg: ExperimentConfig,
    *,
    steps: int,
    loop: LoopResult,
    first_step: int,
    runlog: RunLog,
    before: dict,
    after: dict,
    model,
    rollout_dtype: str,
    trainer_threads: int,
    resumed_from: int | None,
    model_info: dict,
    code: dict,
    controller,
    rewards,
    store,
    checkpoints,
    t_start: float,
) -> RunSummary:
    """The summary of a finished run (``loop``: what the training loop did in this process; ``code``:
    what it ran, ``run/folder.py`` code_version)."""
    warm_step = first_step - 1 + cfg.trainer.warmup_steps_for_throughput
    if loop.warm is not None and steps > warm_step:  # this process's steps after its own warm-up, so a
        eff = (loop.tokens - loop.warm[1]) / (loop.end - loop.warm[0])  # resumed run is not credited with
        throughput_steps = steps - warm_step  # the time before the stop
    else:  # too short to leave out a warm-up
        eff, throughput_steps = loop.tokens / max(loop.end - loop.start, 1e-9), steps - first_step + 1
    frame = runlog.ledger_frame()
    trained_lengths = frame["n_tokens"].astype(int).tolist()
    m = runlog.metrics
    reward_wait = sum(r["reward_wait_s"] for r in m if r["step"] >= first_step and "reward_wait_s" in r)
    rl_time = loop.end - loop.start
    ws = model_info.get("warm_start")
    return RunSummary(
        name=cfg.name,
        code=code,
        accuracy_before=before["accuracy"],
        accuracy_after=after["accuracy"],
        # (a run resumed from a state saved before it was measured has no answered share before RL)
        **(
            {"answered_before": before["answered"], "answered_after": after["answered"]} if "answered" in before else {}
        ),
        n_eval_problems=before["n"],
        steps=steps,
        final_version=loop.version,
        eta=cfg.trainer.eta,
        objective=cfg.trainer.objective,
        trainer_backend=cfg.trainer.backend.kind,
        dtype=dtype_name(model.dtype),
        rollout_dtype=rollout_dtype,
        weight_update=cfg.rollout.weight_update,
        trainer_torch_threads=trainer_threads,
        weight_transport=cfg.rollout.transport().kind,
        microbatching=cfg.trainer.microbatching,
        max_staleness_observed=max(r["staleness_max"] for r in m),
        effective_train_tokens_per_s=eff,
        throughput_steps=throughput_steps,
        tokens_trained=int(sum(trained_lengths)),
        resumed_from_step=resumed_from,
        warm_start={k: ws.get(k) for k in ("steps", "val_accuracy", "wall_s", "cached")} if ws else None,
        rollout_resubmits=controller.resubmitted,
        rollout_pool=controller.pool_changes(),
        grading_resubmits=rewards.n_resubmitted,
        grading_tasks=rewards.n_tasks,
        grading_timeouts=rewards.n_timed_out,
        grading_failures=rewards.n_failed,
        rl_time_s=rl_time,
        reward_wait_s=reward_wait,
        reward_wait_share=reward_wait / max(rl_time, 1e-9),
        wall_time_s=time.perf_counter() - t_start,
        answer_length_before=percentiles(before["lengths"]),
        answer_length_after=percentiles(after["lengths"]),
        trained_answer_length=percentiles(trained_lengths),
        ledger_check=check_ledger(frame, steps, cfg.trainer.batch_size, cfg.trainer.eta),
        checkpoints=store.url,
        checkpoint_writes=checkpoints.written,
        checkpoint_bytes_per_step=sum(w["bytes"] for w in checkpoints.written) / max(1, steps - first_step + 1),
        cost=cost_summary(
            [r for r in m if r["step"] >= first_step],
            wall_s=time.perf_counter() - t_start,
            setup_s=loop.start - t_start,
            rl_s=rl_time,
            tokens_trained=loop.tokens,
            generated_tokens=controller.generated_tokens,
            cfg=cfg.cost,
            n_servers=m[-1].get("cost_rollout_devices", cfg.rollout.n_servers),
        ),
    )


def _lengths(p: dict) -> str:
    return f"p50 {p['p50']:.0f}  p90 {p['p90']:.0f}  max {p['max']}"


def _answered(s: RunSummary) -> str:
    """Format apart from accuracy: the share of answers stated in a form the grader reads, and how
    many of those were right."""

    def right(acc: float, share: float) -> str:
        return f"{acc / share:.3f}" if share else "-"

    return (
        f"before RL {s['answered_before']:.3f} -> after RL {s['answered_after']:.3f}; right among them "
        f"{right(s['accuracy_before'], s['answered_before'])} -> {right(s['accuracy_after'], s['answered_after'])}"
    )


def summary_rows(s: RunSummary) -> list[tuple[str, str]]:
    """The summary for people, as (measure, value) rows: printed by ``areal-flow train``, a table in the UI."""
    rows = [
        (
            f"held-out accuracy ({s['n_eval_problems']} problems)",
            (
                f"before RL {s['accuracy_before']:.3f} -> after RL {s['accuracy_after']:.3f} "
                f"({s['accuracy_after'] - s['accuracy_before']:+.3f})"
            ),
        ),
        *(  # (summaries written before it was recorded have none)
            [("held-out answers in a form graded", _answered(s))] if "answered_before" in s else []
        ),
        ("steps / eta / objective", f"{s['steps']} / {s['eta']} / {s['objective']}"),
        ("max staleness seen", str(s["max_staleness_observed"])),
        *(  # (a summary that records no dtype gets no such row; the servers' is recorded apart)
            [("computing in", f"{s['dtype']} (trainer), {s.get('rollout_dtype', s['dtype'])} (rollout servers)")]
            if "dtype" in s
            else []
        ),
        ("effective training throughput", f"{s['effective_train_tokens_per_s']:.0f} tokens/s"),
        ("RL time / wall time", f"{s['rl_time_s']:.0f} s / {s['wall_time_s']:.0f} s"),
    ]
    if "answer_length_before" in s:  # (summaries written before these were recorded have none)
        rows[1:1] = [
            (
                "answer length (tokens)",
                (f"before: {_lengths(s['answer_length_before'])}   after: {_lengths(s['answer_length_after'])}"),
            ),
            ("trained answers (tokens)", _lengths(s["trained_answer_length"])),
        ]
    if not math.isnan(s.get("reward_wait_s", math.nan)):  # NaN: a multi-turn episode, not measured
        rows.append(
            (
                "trainer waiting on grades alone",
                f"{s['reward_wait_s']:.1f} s ({100 * s['reward_wait_share']:.1f} % of RL time)",
            )
        )
    rows.append(
        ("ledger", "every trajectory trained exactly once" if s["ledger_check"]["ok"] else str(s["ledger_check"]))
    )
    if s.get("cost"):  # (summaries written before the cost ledger have none)
        rows.append(("where the time went", cost_line(s["cost"])))
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from step", str(s["resumed_from_step"])))
    return rows
