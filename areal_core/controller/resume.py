"""The controller's state across a restart.

``snapshot`` is a consistent cut of everything admitted and not trained (rewarded groups in the
buffer, answers being graded, and the partial output of answers being generated, as the servers
reported it at the last ``refresh_partials()``) plus the prompt stream position. ``restore`` puts
it back before the controller starts: rewarded answers go to the buffer, finished ones to grading,
partial ones are continued.
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from areal_core.types import Trajectory

if TYPE_CHECKING:
    from areal_core.controller.core import RolloutController

log = logging.getLogger(__name__)


def log_refresh_error(fut: Future) -> None:
    """A background read of partial outputs failed: nobody waits for it, and a snapshot without
    fresh partial outputs is still exact, so it is logged."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("reading partial outputs failed: %r", fut.exception())


def snapshot(c: RolloutController) -> dict:
    """The cut, JSON-friendly. Runs on the controller's loop, so nothing it does interleaves."""
    # A partial output read from a server is a prefix of that request's answer for as long as
    # the request runs (generation only appends), so one read during the training step is as
    # good as one read now. It applies only while we still hold what we held when asking:
    # once the answer came back (or was resubmitted), it is superseded.
    partials = c.generator.partials
    with c._lock:  # reward callbacks (Dask threads) put into the buffer under this lock
        groups = c.buffer.snapshot()
        live = {}
        for tid, t in c._live.items():
            row = copy.deepcopy(t.to_row())  # generation goes on extending t's lists
            asked, p = partials.get(tid, (None, None))
            if p is not None and not t.finished and asked == len(t.output_ids):
                row["output_ids"] = row["output_ids"] + p.output_ids
                row["output_logprobs"] = row["output_logprobs"] + p.logprobs
                row["output_versions"] = row["output_versions"] + p.versions
                if row["output_mask"]:
                    row["output_mask"] = row["output_mask"] + [1] * len(p.output_ids)
            live.setdefault(t.group_id, []).append(row)
        # the sampler has seen every finished group; the tallies hold the others' answers so far
        state = c.admission.state()
        # the agents' records hold every answer rewarded so far (those in the buffer too); frozen
        # groups in flight are left out (evaluation only: a resumed run does not redo them)
        if c.agents is not None:
            state["agents"] = c.agents.router.state()
    for g in groups:
        g["trajectories"] = g.pop("done") + live.pop(g["group_id"], [])
    if live:
        raise RuntimeError(f"snapshot: answers of groups {sorted(live)[:5]} are not in the buffer")
    return {**state, "groups": groups}


def restore(c: RolloutController, state: dict) -> None:
    """Put a ``snapshot`` back into a controller that has not started."""
    c.admission.restore(state)
    if c.agents is not None and state.get("agents"):  # (a state saved without agents has none)
        c.agents.router.restore(state["agents"])
    for g in state["groups"]:
        c.buffer.admit(g["group_id"], g["first_seq_no"], g["admit_version"], g["size"])
        for row in g["trajectories"]:
            traj = Trajectory.from_row(copy.deepcopy(row))  # generation extends its lists
            if traj.reward is not None:
                c.buffer.put(traj)
            else:
                c._live[traj.traj_id] = traj
                c._restored.append(traj)
