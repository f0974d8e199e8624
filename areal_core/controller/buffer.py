"""Replay buffer: rewarded trajectories wait here until the trainer takes them.

The unit is a *group*: the n answers sampled for one prompt, admitted together.
A group becomes ready once all its answers are generated and rewarded. Each
group is handed out exactly once, oldest (lowest admission number) first.

``take`` also enforces the staleness bound on what is trained: a group admitted
while the policy was at version v may only be trained by a trainer at version
<= v + eta. So before the trainer at version i trains, every untrained group
admitted at version <= i - eta must be in its batch; ``take`` waits for those.
With the admission gate of ``staleness_allows`` there are never more than B
such trajectories, and with eta = 0 this is exactly synchronous RL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from areal_core.types import Trajectory


class BufferClosed(RuntimeError):
    """The producer side stopped (or failed) while the trainer was waiting."""


@dataclass
class _Group:
    group_id: str
    first_seq_no: int
    admit_version: int
    size: int
    done: list[Trajectory] = field(default_factory=list)
    grading: set[str] = field(default_factory=set)  # answers sent to the grader, not yet put
    generated_since: float | None = None  # time.monotonic() when its last answer was generated

    def mark_generated(self) -> None:
        if self.generated_since is None and self.generated:
            self.generated_since = time.monotonic()

    @property
    def ready(self) -> bool:
        return len(self.done) == self.size

    @property
    def generated(self) -> bool:
        """Every answer generated: rewarded, or with the grader."""
        return len(self.done) + len(self.grading) == self.size


class ReplayBuffer:
    def __init__(self, ordered: bool = False) -> None:
        """``ordered``: each batch is the oldest admitted groups, waiting for any not yet rewarded
        (``rollout.deterministic``: batch composition follows admission order, not timing)."""
        self.ordered = ordered
        self._cond = threading.Condition()
        self._groups: dict[str, _Group] = {}  # admitted, not yet handed out
        self._error: BaseException | None = None
        self._closed = False
        self.handed_out = 0  # trajectories
        self.last_reward_wait_s = 0.0  # of the last take: its wait for grades alone

    # producer side -------------------------------------------------------
    def admit(self, group_id: str, first_seq_no: int, admit_version: int, size: int) -> None:
        with self._cond:
            if group_id in self._groups:
                raise ValueError(f"group {group_id} admitted twice")
            self._groups[group_id] = _Group(group_id, first_seq_no, admit_version, size)

    def put(self, traj: Trajectory) -> None:
        """Add one rewarded trajectory of an admitted group."""
        with self._cond:
            g = self._groups.get(traj.group_id)
            if g is None:
                raise KeyError(f"trajectory {traj.traj_id}: its group {traj.group_id} was never admitted")
            if any(t.traj_id == traj.traj_id for t in g.done):
                raise ValueError(f"trajectory {traj.traj_id} put twice")
            g.done.append(traj)
            g.grading.discard(traj.traj_id)
            g.mark_generated()
            if g.ready:
                self._cond.notify_all()

    def grading(self, group_id: str, traj_ids: list[str]) -> None:
        """``traj_ids`` of ``group_id`` are final and with the grader (for ``reward_wait_s``); a group
        the buffer does not hold (never admitted to it, or already trained) is ignored."""
        with self._cond:
            g = self._groups.get(group_id)
            if g is None:
                return
            g.grading.update(traj_ids)
            g.mark_generated()
            if g.generated:
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wake the trainer with the producer's error."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # consumer side -------------------------------------------------------
    def _pick(self, n_traj: int, version: int, eta: int, ready=lambda g: g.ready) -> list[_Group] | None:
        """Whole groups for the batch at ``version``, or None to wait (``ready``: which groups count as ready).

        A group admitted at version a must be trained by version a + eta (its deadline).
        Due groups (deadline == version) go first; the rest of the batch is the oldest ready
        groups, unless taking them would leave the older groups still generating more than the
        batches before their deadlines can hold (earliest-deadline-first): then wait for those.
        """
        groups = sorted(self._groups.values(), key=lambda g: g.first_seq_no)
        if not _deadlines_fit(groups, version, eta, n_traj, first_batch=version):
            raise RuntimeError(
                f"staleness bound cannot hold at version {version} with eta {eta}: more untrained "
                f"trajectories are due than batches of {n_traj} can take before their deadlines; "
                "were requests admitted without the staleness gate?"
            )
        if self.ordered:  # the oldest groups, in order, once all of them are ready
            picked, count = [], 0
            for g in groups:
                if count >= n_traj:
                    break
                picked.append(g)
                count += g.size
            return picked if count == n_traj and all(ready(g) for g in picked) else None
        due = [g for g in groups if g.admit_version <= version - eta]
        if any(not ready(g) for g in due):
            return None
        picked, count = list(due), sum(g.size for g in due)
        for g in groups:
            if count >= n_traj:
                break
            if ready(g) and g not in picked:
                if count + g.size > n_traj:
                    continue
                picked.append(g)
                count += g.size
        if count != n_traj:
            return None
        left = [g for g in groups if g not in picked]
        return picked if _deadlines_fit(left, version, eta, n_traj, first_batch=version + 1) else None

    def take(self, n_traj: int, version: int, eta: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until n_traj trajectories can be trained at ``version``; return them, oldest first.

        ``last_reward_wait_s`` is then how long of the wait was for grades only: from the first moment
        the batch could have been picked had every answer with the grader been rewarded (see
        ``grading``) to the release. Groups whose answers are never marked (multi-turn episodes)
        count as generated only once rewarded, so for them it reads 0."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        generated_at = None
        with self._cond:
            while True:
                if self._error is not None:
                    raise BufferClosed(f"rollout failed: {self._error!r}") from self._error
                picked = self._pick(n_traj, version, eta)
                if picked is not None:
                    break
                if generated_at is None:
                    generated = self._pick(n_traj, version, eta, lambda g: g.generated)
                    if generated is not None:  # since its last group's last answer was generated (stamped
                        # then, not when this thread woke to see it)
                        generated_at = max(
                            [started]
                            + [time.monotonic() if g.generated_since is None else g.generated_since for g in generated]
                        )
                if self._closed:
                    raise BufferClosed("rollout stopped before a full batch was ready")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no batch of {n_traj} ready within {timeout} s")
                self._cond.wait(remaining if remaining is not None else 1.0)
            self.last_reward_wait_s = 0.0 if generated_at is None else time.monotonic() - generated_at
            picked.sort(key=lambda g: g.first_seq_no)
            out: list[Trajectory] = []
            for g in picked:
                del self._groups[g.group_id]
                out.extend(sorted(g.done, key=lambda t: t.seq_no))
            self.handed_out += len(out)
            return out

    # resume --------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """Every admitted, untrained group with its rewarded trajectories (copies), oldest first.

        ``done`` holds trajectory rows (``Trajectory.to_row``); the rest of each group is
        still being generated or graded, which the controller's snapshot records.
        """
        with self._cond:
            return [
                {
                    "group_id": g.group_id,
                    "first_seq_no": g.first_seq_no,
                    "admit_version": g.admit_version,
                    "size": g.size,
                    "done": [t.to_row() for t in sorted(g.done, key=lambda t: t.seq_no)],
                }
                for g in sorted(self._groups.values(), key=lambda g: g.first_seq_no)
            ]

    # introspection -------------------------------------------------------
    def counts(self) -> dict[str, int]:
        with self._cond:
            ready = sum(g.size for g in self._groups.values() if g.ready)
            pending = sum(g.size for g in self._groups.values()) - ready
            return {"ready": ready, "pending": pending, "handed_out": self.handed_out}


def _deadlines_fit(groups, version: int, eta: int, batch: int, first_batch: int) -> bool:
    """Whether the batches at versions first_batch.. can train every group by its deadline."""
    owed = 0
    for g in sorted(groups, key=lambda g: g.admit_version):
        owed += g.size
        if owed > (g.admit_version + eta - first_batch + 1) * batch:
            return False
    return True
