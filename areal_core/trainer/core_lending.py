"""Core lending: while this machine's rollout servers generate nothing, the trainer computes on their cores too.

On one machine an asynchronous run splits the cores: the embedded servers keep
``rollout.torch_threads`` each, the trainer the rest (``run.trainer_torch_threads``). When the
trainer is the slower side, the servers reach the staleness bound eta and wait for the next
version, their cores idle for much of every step. With lending the trainer asks, before each of
its linear layers runs forward and backward, whether any generate request is in flight; if none
is, it computes on ``base + lent`` threads, else on its ``base`` share. Nothing waits on anything:
a request that arrives while the trainer is inside one layer shares the cores for that layer only.

(Not one fixed larger thread count: OpenMP threads that outnumber the cores stall each parallel
region on the one descheduled thread; measured, two trainer threads beside a generating server
gave the trainer nothing.)

Lending pays only where the servers sit idle for long stretches, the trainer the slower side by
far. Where they generate most of the time and are idle only in short gaps (a small model, the two
sides nearly matched), a borrowed thread keeps colliding with a server starting again and costs
more than it brings (``python -m bench core_lending``: the tiny model, its server idle in a tenth
to a third of the trainer's layer passes, trains slower with lending; SmolLM2, idle in three
quarters of them, faster). So the
trainer borrows during a step only if the servers were idle in at least ``min_idle_share`` of its
layer passes of the step before (``end_step``); it keeps counting them while it does not borrow.
Whatever that share, it borrows while the servers are idle *and* admission waits at the staleness
gate (``held``): then no request can start before this step's new version reaches them, so the
idle stretch lasts to the step's end and a borrowed thread collides with nothing (a multi-turn
episode's next turn aside). Without it, a trainer whose servers were idle in a little under
``min_idle_share`` of a step's passes computed the next step on its own threads alone while they
waited at the gate for it (docs/PERFORMANCE.md, "The TRL peer").

Only ``omp_set_num_threads``'s caller is affected, so the hooks run on the training thread:
forward pre-hooks, and for the backward a hook on each layer's output gradient (CPU backward runs
on the thread that called it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_core.numerics import thread_invariant

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepShares:
    """Of a step's layer passes (forward or backward), the share that found the servers idle and the
    share that ran on their cores too; and the step's seconds by the threads it computed on, each
    pass counted from its start to the next pass's, the last one's to ``end_step`` (so the
    optimizer's step and what else runs before the step's row counts with it); the time before the
    first pass counts in neither."""

    idle: float
    lent: float
    own_s: float  # on the trainer's own threads (the servers generating, or this step not borrowing)
    lent_s: float  # on the servers' threads too


def _never() -> bool:
    return False


class CoreLending:
    """``busy()``: whether the rollout servers have work now; ``base``: the trainer's own threads;
    ``lent``: the servers' threads it may borrow while they have none; ``min_idle_share``: the share
    of the last step's layer passes the servers must have been idle in for this step to borrow;
    ``held()``: whether the servers can get no new work before the trainer's next version (admission
    waits at the staleness gate), when an idle pass borrows whatever the last step's share;
    ``clock``: seconds, for the step's time on each thread count."""

    def __init__(
        self,
        busy: Callable[[], bool],
        base: int,
        lent: int,
        min_idle_share: float,
        held: Callable[[], bool] = _never,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if base < 1 or lent < 1:
            raise ValueError(f"core lending needs base >= 1 and lent >= 1 threads, got {base} and {lent}")
        if not 0.0 <= min_idle_share <= 1.0:
            raise ValueError(f"core lending's min_idle_share must be in [0, 1], got {min_idle_share}")
        self.busy, self.base, self.lent, self.min_idle_share = busy, base, lent, min_idle_share
        self.held, self.clock = held, clock
        self.borrowing = True  # in this step (the first one: until a step says otherwise)
        self.checks = 0  # layer passes (forward or backward) the trainer started this step
        self.idle = 0  # of which found the servers idle
        self.borrowed = 0  # of which ran on the lent cores too
        self.seconds = {False: 0.0, True: 0.0}  # this step's seconds on its own threads (False) and lent ones
        self._pass: tuple[float, bool] | None = None  # the last pass's start, and whether it borrowed
        self._handles: list = []

    def __deepcopy__(self, memo) -> CoreLending:
        # a copy of a hooked model (a reference model, a merged copy) shares this lending rather than
        # copying ``busy``'s controller with its locks and sockets; its hooks go quiet at ``remove``
        return self

    def adjust(self, *_) -> None:
        if not self._handles:  # removed: a copied model's hooks outlive the handles
            return
        idle = not self.busy()
        n = self.base + self.lent if idle and (self.borrowing or self.held()) else self.base
        self.checks += 1
        self.idle += idle
        self.borrowed += n > self.base
        self._pass = (self._tally(), n > self.base)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _tally(self) -> float:
        """Now, after adding the time since the last pass started to its thread count's seconds."""
        now = self.clock()
        if self._pass is not None:
            self.seconds[self._pass[1]] += now - self._pass[0]
        return now

    def _after_forward(self, _module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self.adjust)  # runs when its gradient is ready: this layer's backward is next

    def install(self, model: torch.nn.Module) -> CoreLending:
        """Hook every linear layer of ``model`` (the bulk of a decoder's work)."""
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                self._handles.append(m.register_forward_pre_hook(self.adjust))
                self._handles.append(m.register_forward_hook(self._after_forward))
        if not self._handles:
            raise ValueError("core lending: the model has no linear layer to hook")
        return self

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module):
        """``model`` hooked for the block's duration."""
        self.install(model)
        try:
            yield self
        finally:
            self.remove()

    def remove(self) -> None:
        """Unhook the model and go back to the trainer's own share."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        torch.set_num_threads(self.base)

    def end_step(self) -> StepShares | None:
        """Close the step: its shares (None: no layer pass), and whether the next step borrows (the
        servers idle in at least ``min_idle_share`` of this step's passes; a step without passes
        leaves it as it was). Until the next layer pass the trainer is back on its own share: what
        runs between steps (publishing, a checkpoint's copy) would otherwise keep the threads of the
        last pass, and collide with the servers when they start generating."""
        if self._handles and torch.get_num_threads() != self.base:
            torch.set_num_threads(self.base)
        if self._pass is not None:
            self._tally()
            self._pass = None
        if not self.checks:
            return None
        shares = StepShares(
            self.idle / self.checks, self.borrowed / self.checks, self.seconds[False], self.seconds[True]
        )
        self.borrowing = shares.idle >= self.min_idle_share
        self.checks = self.idle = self.borrowed = 0
        self.seconds = {False: 0.0, True: 0.0}
        return shares


def lent_threads(cfg, trainer_threads: int, cores: int, device: torch.device, dtype: torch.dtype) -> int:
    """How many threads the trainer of ``cfg`` (an ExperimentConfig) may borrow from this machine's
    embedded rollout servers while they are idle: their share of the cores when the trainer's share
    was left to the default split (``trainer.torch_threads`` unset), the trainer is the in-process
    torch one, on the CPU (``device``), and ``trainer.lend_idle_cores`` is on (its default: where the
    arithmetic in ``dtype`` does not depend on the thread count, ``numerics.thread_invariant``); else 0."""
    t = cfg.trainer
    if t.torch_threads is not None or t.backend.kind != "torch" or device.type != "cpu":
        return 0
    if cfg.rollout.backend.kind != "embedded" or t.lend_idle_cores is False:
        return 0
    if t.lend_idle_cores is None:
        invariant, why = thread_invariant(dtype)
        if not invariant:
            log.info("core lending off: %s, so a run repeats only on one thread count", why)
            return 0
    return max(0, cores - trainer_threads)
