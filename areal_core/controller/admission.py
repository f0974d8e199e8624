"""Admission: which prompt goes next (the prompt sampler, with its curriculum) and when (the staleness
gate). A group of n answers is admitted only once the last of its n requests passes the gate, so no
trained token can be staler than eta (``algo.staleness``).

Deterministic mode (``rollout.deterministic``): wave k (the trajectories with seq_no in [kB, (k+1)B),
the batch of step k + 1) is admitted at version max(0, k - eta) and, since the controller pushes
version v + 1 only once waves up to v + eta are rewarded, generated entirely at that version. The
curriculum learns from finished groups in admission order: before wave k is drawn it has seen
exactly the groups of waves up to k - eta - 1 (all trained by then), whatever order they finished in."""

from __future__ import annotations

import asyncio
import time

from areal_core.algo import staleness_allows
from areal_core.controller.prompt_sampling import make_sampler
from areal_core.controller.settings import ControllerSettings, group_id
from areal_core.types import Prompt, Trajectory


class Admission:
    """The prompt stream's position, the per-group tallies the curriculum learns from, and the gate.
    The caller holds its lock around ``draw``, ``count`` and the reads (reward callbacks run in Dask threads)."""

    def __init__(self, prompts: list[Prompt], settings: ControllerSettings, version: int):
        self.s, self._prompts = settings, prompts
        self.sampler = make_sampler(prompts, settings.shuffle, settings.seed, settings.curriculum)
        self.tally: dict[str, list] = {}  # group id -> [prompt id, correct, rewarded] until all n are in
        self.n_submitted = 0  # requests admitted to the trainable policy: the gate counts them
        self.n_groups = 0  # prompts drawn from the stream: its position
        self.version = version  # the servers' weight version the gate last confirmed
        self._gate: asyncio.Condition | None = None
        self._deferred: dict[int, tuple] = {}  # deterministic mode: first seq_no -> a finished group's tally
        self._first_seq: dict[str, int] = {}  # deterministic mode: group id -> its first seq_no
        self.gate_wait_s = 0.0  # time admission spent held at the gate (the cost ledger's "gate")
        self.held = False  # admission is held at the gate now: no new request before the next version

    async def wait(self) -> None:
        """Until one more group of n passes the gate (the last of its n requests must)."""
        if self._gate is None:
            self._gate = asyncio.Condition()
        n, B, eta = self.s.n_samples, self.s.batch_size, self.s.eta
        allowed = lambda: staleness_allows(self.n_submitted + n - 1, self.version, B, eta)  # noqa: E731
        async with self._gate:
            if not allowed():
                t0 = time.perf_counter()
                self.held = True
                try:
                    await self._gate.wait_for(allowed)
                finally:
                    self.held = False
                self.gate_wait_s += time.perf_counter() - t0

    async def advance(self, version: int) -> None:
        """Every server holds ``version``: the gate moves."""
        if self._gate is None:
            self._gate = asyncio.Condition()
        async with self._gate:
            self.version = version
            self._gate.notify_all()

    def draw(self, trainable: bool) -> tuple[str, Prompt]:
        """The next prompt and its group id; a group on the trainable policy is tallied for the curriculum."""
        if self.s.deterministic:
            self._observe_through((self.n_submitted // self.s.batch_size) - self.s.eta - 1)
        epoch, prompt = self.sampler.next()
        gid = group_id(epoch, prompt.id)
        if trainable:  # the curriculum follows the trained policy's results
            self.tally[gid] = [prompt.id, 0, 0]
            if self.s.deterministic:
                self._first_seq[gid] = self.n_submitted
        self.n_groups += 1
        return gid, prompt

    def count(self, traj: Trajectory) -> None:
        """Tally a rewarded answer; a group's last one tells the sampler."""
        tally = self.tally.setdefault(traj.group_id, [None, 0, 0])  # None: a state saved without tallies
        tally[1] += bool(traj.correct)
        tally[2] += 1
        if tally[2] == self.s.n_samples:
            del self.tally[traj.group_id]
            if tally[0] is not None:
                if self.s.deterministic:
                    self._deferred[self._first_seq.pop(traj.group_id, traj.seq_no)] = tuple(tally)
                else:
                    self.sampler.observe(tally[0], tally[1], tally[2])

    def settled(self, trained: int):
        """The sampler as a report reads it once the trajectories with seq_no < ``trained`` are trained.
        Deterministic mode: a copy that has learned, in admission order, every finished group among
        them (the sampler itself learns a group only when a later wave is drawn, which follows timing);
        otherwise the sampler itself."""
        if not self.s.deterministic:
            return self.sampler
        view = make_sampler(self._prompts, self.s.shuffle, self.s.seed, self.s.curriculum, self.sampler.state())
        for first in sorted(f for f in self._deferred if f < trained):
            view.observe(*self._deferred[first])
        return view

    def _observe_through(self, wave: int) -> None:
        """Deterministic mode: the curriculum learns, in admission order, every finished group of waves <= ``wave``."""
        for first in sorted(f for f in self._deferred if f // self.s.batch_size <= wave):
            self.sampler.observe(*self._deferred.pop(first))

    def state(self) -> dict:
        return {
            "n_submitted": self.n_submitted,
            "n_groups": self.n_groups,
            "version": self.version,
            "sampler": self.sampler.state(),
            "tally": {gid: list(t) for gid, t in self.tally.items()},
        }

    def restore(self, state: dict) -> None:
        self.n_submitted, self.n_groups = int(state["n_submitted"]), int(state["n_groups"])
        self.sampler = make_sampler(
            self._prompts,
            self.s.shuffle,
            self.s.seed,
            self.s.curriculum,
            state.get("sampler") or {"n_drawn": self.n_groups},
        )
        self.tally = {gid: list(t) for gid, t in state.get("tally", {}).items()}
