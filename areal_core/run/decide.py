"""Campaigns that decide: paired seeds, intervals, and whether each setting's difference to the
baseline is clear yet.

Every setting of a campaign runs with the same seeds (seed s: the same warm start, data order and
sampling keys in every setting), so each seed gives a *paired* difference to the baseline; the
spread of the differences, not of the settings' own outcomes, decides. For each setting: the mean
of its outcome with a 95 % Student-t interval, and the mean paired difference to the baseline with
its interval. A difference is **clear** once its interval excludes zero (the setting is better or
worse) or is narrower than the campaign's ``margin`` on each side (the two are the same within it);
``next_seed`` says whether another seed (of the baseline and the unclear settings) is still due.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95


def _t_pdf(x: float, df: float) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf(x: float, df: float, steps: int = 4000) -> float:
    """P(T <= x) for x >= 0, by Simpson's rule from 0 (the density is smooth there)."""
    h = x / steps
    s = _t_pdf(0.0, df) + _t_pdf(x, df)
    s += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, steps))
    return 0.5 + s * h / 3


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The Student-t quantile: x with P(T <= x) = p, for 0.5 < p < 1 (bisection on the CDF)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """A mean and its 95 % Student-t interval over ``n`` values (no interval from one value)."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs: list[float]) -> Interval:
        if not xs:
            raise ValueError("an interval needs at least one value")
        m = statistics.fmean(xs)
        if len(xs) < 2:
            return cls(m, -math.inf, math.inf, 1)
        half = t_quantile(1 - (1 - LEVEL) / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
        return cls(m, m - half, m + half, len(xs))

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def text(self, digits: int = 3) -> str:
        if self.n < 2:
            return f"{self.mean:+.{digits}f} (1 seed)"
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


@dataclass(frozen=True)
class Comparison:
    """One setting of a campaign: its outcome over the seeds, and its paired difference to the
    baseline (None for the baseline itself) with the verdict on it."""

    label: str
    outcome: Interval
    difference: Interval | None
    verdict: str  # "baseline", "better", "worse", "same within the margin", or "unclear"

    @property
    def clear(self) -> bool:
        return self.verdict != "unclear"


def verdict(diff: Interval, margin: float) -> str:
    """What a paired difference's interval says: better or worse (it excludes zero), the same within
    ``margin`` (it lies inside +-margin), or unclear."""
    if diff.n >= 2 and diff.lo > 0:
        return "better"
    if diff.n >= 2 and diff.hi < 0:
        return "worse"
    if diff.n >= 2 and -margin <= diff.lo and diff.hi <= margin:
        return "same within the margin"
    return "unclear"


def compare(outcomes: dict[str, dict[int, float]], baseline: str, margin: float) -> list[Comparison]:
    """``outcomes``: setting -> seed -> outcome (e.g. held-out accuracy after RL). Each setting's
    outcome interval and its difference to ``baseline`` over the seeds both ran, in the given order."""
    if baseline not in outcomes:
        raise ValueError(f"baseline {baseline!r} is not one of the campaign's settings: {', '.join(outcomes)}")
    base = outcomes[baseline]
    out = []
    for label, by_seed in outcomes.items():
        if not by_seed:
            raise ValueError(f"setting {label!r} has no finished run yet")
        outcome = Interval.of([by_seed[s] for s in sorted(by_seed)])
        if label == baseline:
            out.append(Comparison(label, outcome, None, "baseline"))
            continue
        shared = sorted(set(by_seed) & set(base))
        if not shared:
            out.append(Comparison(label, outcome, None, "unclear"))
            continue
        diff = Interval.of([by_seed[s] - base[s] for s in shared])
        out.append(Comparison(label, outcome, diff, verdict(diff, margin)))
    return out


def unclear(comparisons: list[Comparison]) -> list[str]:
    """The settings whose difference to the baseline is not clear yet."""
    return [c.label for c in comparisons if not c.clear]


@dataclass(frozen=True)
class Budget:
    """When a campaign that adds seeds (``--until-clear``) stops: at ``max_seeds`` seeds per setting,
    ``max_runs`` runs in all, or once ``max_minutes`` have passed (None: no such limit)."""

    max_seeds: int = 10
    max_runs: int | None = None
    max_minutes: float | None = None

    def spent(self, seeds: int, runs: int, minutes: float, per_seed: int) -> str | None:
        """Why one more seed (``per_seed`` runs) may not start, or None."""
        if seeds >= self.max_seeds:
            return f"{seeds} seeds, the most asked for (--max-seeds)"
        if self.max_runs is not None and runs + per_seed > self.max_runs:
            return f"{runs} runs; another seed's {per_seed} would pass --max-runs {self.max_runs}"
        if self.max_minutes is not None and minutes >= self.max_minutes:
            return f"{minutes:.0f} min, past --max-minutes {self.max_minutes:g}"
        return None


def next_seed(comparisons: list[Comparison], seeds: int, runs: int, minutes: float, budget: Budget) -> str | None:
    """Why the campaign stops adding seeds (every difference is clear, or the budget is spent), or None:
    run another seed of the baseline and of each setting still unclear."""
    left = unclear(comparisons)
    if not left:
        return "every difference to the baseline is clear"
    spent = budget.spent(seeds, runs, minutes, len(left) + 1)
    return None if spent is None else f"budget spent ({spent}); still unclear: {', '.join(left)}"
