"""Campaign decisions (areal_core/run/decide.py): Student-t intervals against independent references,
paired differences, verdicts, and when a campaign stops adding seeds."""

import math
import random
import statistics

import pytest

from areal_core.run.decide import Budget, Interval, compare, next_seed, t_quantile, unclear, verdict

# two-sided 95 % Student-t critical values, as printed in statistics tables (an independent reference)
TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042}


@pytest.mark.parametrize("df", sorted(TABLE))
def test_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.975, df) == pytest.approx(TABLE[df], abs=6e-4)


def test_t_quantile_approaches_the_normal_one_and_refuses_bad_input():
    assert t_quantile(0.975, 10_000) == pytest.approx(1.95996, abs=1e-3)
    with pytest.raises(ValueError, match=r"0\.5 < p < 1"):
        t_quantile(0.3, 4)


def test_intervals_cover_the_mean_at_their_level():
    """Monte Carlo against the definition: 95 % intervals from 5 normal draws cover the true mean
    about 95 % of the time (2,000 draws: within +-2.5 points)."""
    rng = random.Random(0)
    covered = sum((iv := Interval.of([rng.gauss(1.0, 0.3) for _ in range(5)])).lo <= 1.0 <= iv.hi for _ in range(2000))
    assert 0.925 <= covered / 2000 <= 0.975


def test_an_interval_of_one_value_has_no_bounds():
    iv = Interval.of([0.4])
    assert iv.n == 1 and iv.lo == -math.inf and iv.hi == math.inf and "1 seed" in iv.text()
    xs = [0.40, 0.45, 0.43]
    iv = Interval.of(xs)
    half = TABLE[2] * statistics.stdev(xs) / math.sqrt(3)
    assert iv.mean == pytest.approx(statistics.fmean(xs)) and iv.half_width == pytest.approx(half, rel=1e-3)


def test_pairing_removes_what_the_seeds_share():
    """Seeds differ a lot (0.2 .. 0.6) and a setting is 0.03 better on every seed: unpaired intervals
    overlap, the paired difference is clear."""
    base = {0: 0.20, 1: 0.45, 2: 0.60, 3: 0.33}
    better = {s: v + 0.03 + 0.002 * (s % 2) for s, v in base.items()}
    same = {s: v + (0.001 if s % 2 else -0.001) for s, v in base.items()}
    comps = {c.label: c for c in compare({"base": base, "better": better, "same": same}, "base", margin=0.01)}
    assert comps["base"].verdict == "baseline" and comps["base"].difference is None
    assert comps["better"].outcome.lo < comps["base"].outcome.hi  # unpaired: they overlap
    assert comps["better"].verdict == "better" and comps["better"].difference.lo > 0
    assert comps["same"].verdict == "same within the margin"


def test_verdicts_and_what_stays_unclear():
    assert verdict(Interval(-0.05, -0.08, -0.02, 3), 0.01) == "worse"
    assert verdict(Interval(0.01, -0.04, 0.06, 3), 0.01) == "unclear"
    assert verdict(Interval(0.05, 0.05, 0.05, 1), 0.01) == "unclear"  # one seed decides nothing
    comps = compare({"b": {0: 0.4, 1: 0.5}, "x": {0: 0.41, 1: 0.55}}, "b", margin=0.001)
    assert unclear(comps) == ["x"]
    with pytest.raises(ValueError, match="baseline 'nope'"):
        compare({"b": {0: 0.4}}, "nope", 0.01)


def test_a_campaign_adds_seeds_until_clear_or_its_budget_is_spent():
    unclear_comps = compare({"b": {0: 0.4, 1: 0.5}, "x": {0: 0.41, 1: 0.55}}, "b", margin=0.001)
    assert next_seed(unclear_comps, seeds=2, runs=4, minutes=1, budget=Budget()) is None
    assert "--max-seeds" in next_seed(unclear_comps, seeds=3, runs=6, minutes=1, budget=Budget(max_seeds=3))
    assert "--max-runs 7" in next_seed(unclear_comps, seeds=3, runs=6, minutes=1, budget=Budget(max_runs=7))
    assert "--max-minutes" in next_seed(unclear_comps, seeds=3, runs=6, minutes=61, budget=Budget(max_minutes=60))
    assert "still unclear: x" in next_seed(unclear_comps, seeds=3, runs=6, minutes=61, budget=Budget(max_minutes=60))
    clear = compare({"b": {0: 0.4, 1: 0.5}, "x": {0: 0.6, 1: 0.71}}, "b", margin=0.001)
    assert next_seed(clear, seeds=2, runs=4, minutes=1, budget=Budget()) == "every difference to the baseline is clear"
