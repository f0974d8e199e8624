"""Staleness gate: a repeated-subtraction reference and an event-driven mock run."""

import random
from collections import Counter
from fractions import Fraction

import pytest

from areal_core.algo import staleness_allows


def reference_allows(n_submitted, version, batch_size, eta):
    """Request number N_r (1-based) falls into batch k (0-based) by repeated subtraction."""
    remaining, batch_index = n_submitted + 1, 0
    while remaining > batch_size:
        remaining -= batch_size
        batch_index += 1
    return batch_index <= version + eta


def test_matches_reference_on_grid():
    for batch_size in range(1, 8):
        for version in range(6):
            for eta in range(5):
                for n_submitted in range(60):
                    expected = reference_allows(n_submitted, version, batch_size, eta)
                    got = staleness_allows(n_submitted, version, batch_size, eta)
                    assert got is expected, (n_submitted, version, batch_size, eta)


@pytest.mark.parametrize("batch_size,version,eta", [(1, 0, 0), (4, 0, 0), (4, 3, 2), (16, 7, 1), (5, 0, 9)])
def test_admits_exactly_a_prefix_of_size_capacity(batch_size, version, eta):
    allowed = [staleness_allows(n, version, batch_size, eta) for n in range(400)]
    capacity = sum(allowed)
    assert capacity == (version + eta + 1) * batch_size
    assert all(allowed[:capacity]) and not any(allowed[capacity:])
    # the same capacity via exact rational arithmetic: N_r - 1 < (i + eta + 1) * B
    assert all(a == (Fraction(n, batch_size) < version + eta + 1) for n, a in enumerate(allowed))


@pytest.mark.parametrize(
    "args,name",
    [
        ((-1, 0, 4, 0), "n_submitted"),
        ((0, -1, 4, 0), "version"),
        ((0, 0, 0, 0), "batch_size"),
        ((0, 0, -3, 0), "batch_size"),
        ((0, 0, 4, -1), "eta"),
    ],
)
def test_errors_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        staleness_allows(*args)


def test_rejects_non_integers():
    with pytest.raises(TypeError, match="batch_size"):
        staleness_allows(0, 0, 2.5, 0)


def simulate(batch_size, eta, concurrency, n_versions, seed):
    """Mock rollout + trainer; returns per-version admission counts and staleness of consumed data."""
    rng = random.Random(seed)
    version, admitted = 0, 0
    in_flight, done = [], []  # entries: (seq_no, version at admission)
    admitted_per_version = Counter()
    staleness = []
    steps = 0
    while version < n_versions:
        steps += 1
        assert steps < 100_000, "simulation did not finish"
        # rollout side: admit while the gate and the concurrency limit allow
        while len(in_flight) < concurrency and staleness_allows(admitted, version, batch_size, eta):
            in_flight.append((admitted, version))
            admitted_per_version[version] += 1
            admitted += 1
            assert admitted <= (version + eta + 1) * batch_size
        # trainer side: consume a batch whenever one is ready
        if len(done) >= batch_size:
            batch, done = done[:batch_size], done[batch_size:]
            staleness.extend(version - v for _, v in batch)
            version += 1
            continue
        # otherwise some generation must be running, or the system is deadlocked
        assert in_flight, f"deadlock at version {version}: {admitted} admitted, {len(done)} done"
        done.append(in_flight.pop(rng.randrange(len(in_flight))))
    return admitted_per_version, staleness


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("concurrency_factor", [0.5, 1, 3])
def test_simulation_respects_gate_and_never_deadlocks(batch_size, eta, concurrency_factor):
    concurrency = max(1, int(batch_size * concurrency_factor))
    for seed in range(3):
        per_version, staleness = simulate(batch_size, eta, concurrency, n_versions=8, seed=seed)
        assert len(staleness) == 8 * batch_size
        cumulative = 0
        for v in range(8):
            cumulative += per_version[v]
            assert cumulative <= (v + eta + 1) * batch_size
        if eta == 0:
            # synchronous RL: exactly B per version, always trained on fresh data
            assert all(per_version[v] == batch_size for v in range(8))
            assert set(staleness) == {0}
