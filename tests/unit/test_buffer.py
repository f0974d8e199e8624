"""The replay buffer: exactly once, oldest first, and the staleness bound on what is trained."""

import random
import threading

import pytest

from areal_core.algo import staleness_allows
from areal_core.controller.buffer import BufferClosed, ReplayBuffer
from areal_core.types import Trajectory


def _traj(gid, seq, k, v):
    return Trajectory(traj_id=f"{gid}-s{k}", group_id=gid, seq_no=seq, admit_version=v, prompt_ids=[1])


def _admit_group(buf, gid, first, v, n):
    buf.admit(gid, first, v, n)
    return [_traj(gid, first + k, k, v) for k in range(n)]


def test_oldest_first_and_only_whole_groups():
    buf = ReplayBuffer()
    g0 = _admit_group(buf, "g0", 0, 0, 2)
    g1 = _admit_group(buf, "g1", 2, 0, 2)
    g2 = _admit_group(buf, "g2", 4, 0, 2)
    for t in g2 + g1 + g0[:1]:  # g0 incomplete
        buf.put(t)
    out = buf.take(4, version=0, eta=5, timeout=1)
    assert [t.traj_id for t in out] == ["g1-s0", "g1-s1", "g2-s0", "g2-s1"]
    with pytest.raises(TimeoutError):
        buf.take(2, version=0, eta=5, timeout=0.05)
    buf.put(g0[1])
    assert [t.traj_id for t in buf.take(2, version=0, eta=5, timeout=1)] == ["g0-s0", "g0-s1"]


def test_waits_for_due_groups_even_if_newer_ones_are_ready():
    buf = ReplayBuffer()
    old = _admit_group(buf, "old", 0, 0, 2)
    new = [_admit_group(buf, f"n{i}", 2 + 2 * i, 1, 2) for i in range(2)]
    for g in new:
        for t in g:
            buf.put(t)
    # trainer at version 2 with eta 2: the group admitted at version 0 is due
    with pytest.raises(TimeoutError):
        buf.take(4, version=2, eta=2, timeout=0.05)
    for t in old:
        buf.put(t)
    out = buf.take(4, version=2, eta=2, timeout=1)
    assert {t.group_id for t in out} == {"old", "n0"}


def test_errors_reach_the_trainer():
    buf = ReplayBuffer()
    buf.admit("g", 0, 0, 1)
    threading.Timer(0.05, buf.fail, args=(RuntimeError("server died"),)).start()
    with pytest.raises(BufferClosed, match="server died"):
        buf.take(1, 0, 0)


def test_double_put_and_unknown_group_rejected():
    buf = ReplayBuffer()
    (t,) = _admit_group(buf, "g", 0, 0, 1)
    buf.put(t)
    with pytest.raises(ValueError, match="put twice"):
        buf.put(t)
    with pytest.raises(KeyError, match="never admitted"):
        buf.put(_traj("h", 5, 0, 0))


def test_does_not_take_newer_groups_when_older_ones_would_miss_their_deadline():
    """B 4 (groups of 2), eta 2. At v0 six groups are admitted and g0 is slow; at v1 two more.
    Training the new, short g6 and g7 at v1 would leave g0, g3, g4, g5 (8 answers) due at v2,
    where a batch holds 4: the buffer waits for older groups instead."""
    buf = ReplayBuffer()
    old = [_admit_group(buf, f"g{i}", 2 * i, 0, 2) for i in range(6)]
    for t in old[1] + old[2]:
        buf.put(t)
    assert [t.group_id for t in buf.take(4, version=0, eta=2, timeout=1)] == ["g1", "g1", "g2", "g2"]
    new = [_admit_group(buf, f"g{i}", 2 * i, 1, 2) for i in (6, 7)]
    for t in new[0] + new[1]:
        buf.put(t)
    with pytest.raises(TimeoutError):
        buf.take(4, version=1, eta=2, timeout=0.05)
    for t in old[3] + old[4]:
        buf.put(t)
    assert [t.group_id for t in buf.take(4, version=1, eta=2, timeout=1)] == ["g3", "g3", "g4", "g4"]


def test_unreachable_state_is_an_error_not_a_wait():
    buf = ReplayBuffer()
    for i in range(3):  # 6 answers admitted at v0, due at v0, batch of 4: no choice can work
        for t in _admit_group(buf, f"g{i}", 2 * i, 0, 2):
            buf.put(t)
    with pytest.raises(RuntimeError, match="staleness bound cannot hold"):
        buf.take(4, version=0, eta=0, timeout=1)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_simulated_run_respects_bound_and_trains_each_once(eta):
    """Admission by the gate, random completion order, trainer takes B per version."""
    rng = random.Random(eta)
    B, n, steps = 8, 2, 30
    buf, version, submitted, running, trained = ReplayBuffer(), 0, 0, [], []
    while version < steps:
        while staleness_allows(submitted + n - 1, version, B, eta):
            running.extend(_admit_group(buf, f"g{submitted}", submitted, version, n))
            submitted += n
        rng.shuffle(running)
        slow = {t.group_id for t in running if int(t.group_id[1:]) % 3 == 0} if rng.random() < 0.7 else set()
        for t in [t for t in running if t.group_id not in slow][: rng.randint(1, len(running))]:
            buf.put(t)
            running.remove(t)
        try:
            batch = buf.take(B, version, eta, timeout=0)
        except TimeoutError:
            continue
        assert all(version - t.admit_version <= eta for t in batch)
        trained += [t.traj_id for t in batch]
        version += 1
    assert len(trained) == len(set(trained)) == steps * B


def test_snapshot_lists_untrained_groups_with_their_rewarded_answers():
    buf = ReplayBuffer()
    g0 = _admit_group(buf, "g0", 0, 0, 2)
    g1 = _admit_group(buf, "g1", 2, 1, 2)
    g2 = _admit_group(buf, "g2", 4, 1, 2)
    for t in g0 + g2[:1]:
        t.reward = 1.0
        buf.put(t)
    assert [t.traj_id for t in buf.take(2, version=1, eta=2, timeout=1)] == ["g0-s0", "g0-s1"]
    snap = buf.snapshot()
    assert [g["group_id"] for g in snap] == ["g1", "g2"]
    assert [g["admit_version"] for g in snap] == [1, 1] and snap[0]["done"] == []
    assert [Trajectory.from_row(r).traj_id for r in snap[1]["done"]] == ["g2-s0"]
    assert g1  # admitted, nothing rewarded yet


def test_reward_wait_is_the_part_of_the_wait_spent_on_grades():
    """A batch waiting for answers that are still being generated, then graded: ``last_reward_wait_s``
    counts from the moment every answer it needs was with the grader, not from the start of the wait."""
    import time

    buf = ReplayBuffer()
    g0, g1 = _admit_group(buf, "g0", 0, 0, 2), _admit_group(buf, "g1", 2, 0, 2)
    for t in g0:
        buf.put(t)
    stamps = {}

    def producer():
        time.sleep(0.3)  # g1 generating: not the grader's time
        buf.grading("g1", [t.traj_id for t in g1])
        stamps["graded"] = time.monotonic()
        time.sleep(0.4)  # g1 with the grader
        stamps["put"] = time.monotonic()
        for t in g1:
            buf.put(t)

    th = threading.Thread(target=producer)
    th.start()
    out = buf.take(4, version=0, eta=5, timeout=5)
    released = time.monotonic()
    th.join()
    assert len(out) == 4
    assert stamps["put"] - stamps["graded"] <= buf.last_reward_wait_s <= released - stamps["graded"] + 0.05
    # ready at once: nothing waited on
    g2 = _admit_group(buf, "g2", 4, 0, 2)
    buf.grading("g2", [g2[0].traj_id])  # one answer with the grader, then both rewarded
    for t in g2:
        buf.put(t)
    buf.take(2, version=0, eta=5, timeout=1)
    assert buf.last_reward_wait_s == 0.0
    buf.grading("gone", ["gone-s0"])  # a group not in the buffer (trained, or never admitted): ignored
