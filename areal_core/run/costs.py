"""The cost ledger: where each pool's time went, step by step, what was generated and never
trained, and (with prices) what the run cost; ``cost.budget_usd`` stops the run at a checkpoint.

Two pools. The **trainer** (``trainer_devices`` devices) spends each step's wall time on
``training``, ``weight_sync`` (staging and waiting for the previous push), ``waiting_grades``
(the batch was generated, its grades were not in), ``waiting_rollout`` (the rest of the wait for a
batch), ``checkpoint`` and ``other`` (whatever is left: the step row, progress). The **rollout**
pool (its servers) spends ``n_servers x`` the step's wall time on ``generating`` (the servers'
own busy time: prefill, decode and applying weights), ``gate`` (idle while the staleness gate held
admission) and ``idle``. Outside the steps the run spends ``setup`` (model, servers, held-out
evaluation before RL), ``between_steps`` and ``after`` (held-out evaluation after RL, shutdown);
these and the steps add up to the command's wall time.

Tokens: ``generated`` per step; ``reprefilled`` (positions prefilled again after an in-flight
weight update); at the end ``never_trained`` = generated - trained (answers buffered, in flight, or
past the last step). An aborted request keeps its output here (it continues), so nothing is lost
to aborts. Each step row holds its figures (``cost_*`` columns of metrics.parquet, so a resumed
run keeps them); ``costs.parquet`` is those columns; summary.json holds the totals.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from areal_core.experiment import CostConfig

if TYPE_CHECKING:
    import pandas as pd

TRAINER_STAGES = ("training", "weight_sync", "waiting_grades", "waiting_rollout", "checkpoint", "other")
ROLLOUT_STAGES = ("generating", "gate", "idle")


class CostLedger:
    """Per-step cost rows (see the module docstring)."""

    def __init__(self, cfg: CostConfig):
        self.cfg = cfg
        self._last: dict | None = None  # the pool figures at the end of the previous step

    def start(self, figures: dict) -> None:
        """The servers' counters when the training loop starts."""
        self._last = figures

    def step_row(self, row: dict, figures: dict, generated: int, commit: bool = True) -> dict:
        """The ``cost_*`` columns of one step's metrics ``row`` (its timings), from the pool figures
        (``RolloutController.pool_figures``) at its end; ``commit=False``: a provisional row (a
        checkpoint's copy), the next row still counts from the previous one's figures."""
        wall = row["step_time_s"]
        waited, grades = row.get("wait_time_s", 0.0), row.get("reward_wait_s", 0.0)
        grades = 0.0 if grades is None or math.isnan(grades) else min(grades, waited)
        t = {
            "training": row.get("train_time_s", 0.0),
            "weight_sync": row.get("publish_time_s", 0.0),
            "waiting_grades": grades,
            "waiting_rollout": waited - grades,
            "checkpoint": row.get("checkpoint_time_s", 0.0),
        }
        t["other"] = max(0.0, wall - sum(t.values()))
        last = self._last or figures
        if commit:
            self._last = figures
        n = figures["n_servers"]
        busy = _delta(figures["busy_s"], last["busy_s"])
        pool = n * wall
        generating = min(pool, busy) if busy is not None else math.nan
        gate = min(
            max(0.0, pool - (generating if busy is not None else 0.0)),
            n * (figures["gate_wait_s"] - last["gate_wait_s"]),
        )
        r = {
            "generating": generating,
            "gate": gate,
            "idle": max(0.0, pool - generating - gate) if busy is not None else math.nan,
        }
        out = {f"cost_trainer_{k}_s": v for k, v in t.items()} | {f"cost_rollout_{k}_s": v for k, v in r.items()}
        out.update(
            cost_rollout_devices=n,
            cost_generated_tokens=generated,
            cost_reprefilled_tokens=_delta(figures["reprefilled_tokens"], last["reprefilled_tokens"]),
            cost_usd=self.price(wall, n),
        )
        return out

    def price(self, seconds: float, n_rollout: int) -> float:
        """USD of ``seconds`` of the whole run (both pools), NaN without prices."""
        p = self.cfg.usd_per_device_hour
        if p is None:
            return math.nan
        return seconds / 3600 * (p.rollout * n_rollout + p.trainer * self.cfg.trainer_devices)

    def spent(self, rows: list[dict]) -> float:
        """USD spent by the steps in ``rows`` (0 without prices)."""
        return sum(r["cost_usd"] for r in rows if not math.isnan(r.get("cost_usd", math.nan)))

    def budget_spent(self, rows: list[dict]) -> bool:
        return self.cfg.budget_usd is not None and self.spent(rows) >= self.cfg.budget_usd


def write_parquet(rows: list[dict], path) -> None:
    """``costs.parquet``: each step's ``cost_*`` columns (and its step and wall time)."""
    import pandas as pd

    from areal_core.storage.fsutil import write_parquet_atomic

    keep = [
        {k: v for k, v in r.items() if k.startswith("cost_") or k in ("step", "step_time_s")}
        for r in rows
        if "cost_trainer_training_s" in r
    ]
    write_parquet_atomic(pd.DataFrame(keep), path)


def describe(c: dict) -> str:
    """One line for people: where each pool's time went, and the price."""

    def shares(d: dict) -> str:
        total = sum(v for v in d.values() if not math.isnan(v)) or 1.0
        return ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.005 * total
        )

    usd = "" if c["usd"] is None else f"; {c['usd']:.2f} USD"
    return f"trainer: {shares(c['trainer_s'])} | rollout: {shares(c['rollout_s'])}{usd}"


def plot(costs: pd.DataFrame, path=None):
    """Stacked areas per step, one panel per pool: where its seconds went (``costs.parquet``'s
    columns); saved to ``path`` if given; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharex=True)
    for ax, pool, stages in ((axes[0], "trainer", TRAINER_STAGES), (axes[1], "rollout", ROLLOUT_STAGES)):
        cols = [f"cost_{pool}_{k}_s" for k in stages]
        ax.stackplot(costs["step"], *[costs[c].fillna(0.0) for c in cols], labels=stages, alpha=0.85)
        ax.set_title(f"{pool} pool: seconds per step" + (" (x servers)" if pool == "rollout" else ""))
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _delta(now, before):
    """A counter's growth; a counter that went back (its server restarted) counts from 0."""
    if now is None or before is None:
        return None
    return now - before if now >= before else now


def shares(totals: dict) -> dict[str, dict[str, float]]:
    """A run's totals (``summary``'s result, summary.json's ``cost``) as each pool's share of its time
    by stage; stages not measured (NaN) left out."""
    out = {}
    for pool, key in (("rollout", "rollout_s"), ("trainer", "trainer_s")):
        known = {k: v for k, v in totals[key].items() if v is not None and not math.isnan(v)}
        total = sum(known.values())
        out[pool] = {k: v / total for k, v in known.items()} if total else {}
    return out


def describe_shares(by_pool: dict[str, dict[str, float]]) -> str:
    """``rollout: generating 62%, gate 20%, idle 18%; trainer: training 70%, ...``"""
    return "; ".join(f"{pool}: " + ", ".join(f"{k} {v:.0%}" for k, v in s.items()) for pool, s in by_pool.items())


def summary(
    rows: list[dict],
    *,
    wall_s: float,
    setup_s: float,
    rl_s: float,
    tokens_trained: int,
    generated_tokens: int,
    cfg: CostConfig,
    n_servers: int,
) -> dict:
    """The run's totals: each pool's seconds by stage, the phases outside the steps, tokens and USD.
    ``check``: how far the phases and steps add up to the wall time (they do by construction,
    each measured on its own)."""
    steps = [r for r in rows if "cost_trainer_training_s" in r]
    step_s = sum(r["step_time_s"] for r in steps)
    trainer = {k: sum(r[f"cost_trainer_{k}_s"] for r in steps) for k in TRAINER_STAGES}
    rollout = {k: sum(r[f"cost_rollout_{k}_s"] for r in steps) for k in ROLLOUT_STAGES}
    phases = {
        "setup": setup_s,
        "steps": step_s,
        "between_steps": max(0.0, rl_s - step_s),
        "after": max(0.0, wall_s - setup_s - rl_s),
    }
    accounted = sum(phases.values())
    usd = CostLedger(cfg).price(wall_s, n_servers)
    return {
        "trainer_s": trainer,
        "rollout_s": rollout,
        "phases_s": phases,
        "wall_s": wall_s,
        "accounted_share": accounted / wall_s if wall_s else math.nan,
        "tokens": {
            "generated": generated_tokens,
            "trained": tokens_trained,
            "reprefilled": sum(r.get("cost_reprefilled_tokens") or 0 for r in steps),
            "never_trained": max(0, generated_tokens - tokens_trained),
        },
        "usd": None if math.isnan(usd) else usd,
        "usd_steps": CostLedger(cfg).spent(steps) if cfg.usd_per_device_hour else None,
        "budget_usd": cfg.budget_usd,
    }
