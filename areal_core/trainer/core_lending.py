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

Only ``omp_set_num_threads``'s caller is affected, so the hooks run on the training thread:
forward pre-hooks, and for the backward a hook on each layer's output gradient (CPU backward runs
on the thread that called it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from areal_core.numerics import thread_invariant

log = logging.getLogger(__name__)


class CoreLending:
    """``busy()``: whether the rollout servers have work now; ``base``: the trainer's own threads;
    ``lent``: the servers' threads it may borrow while they have none."""

    def __init__(self, busy: Callable[[], bool], base: int, lent: int):
        if base < 1 or lent < 1:
            raise ValueError(f"core lending needs base >= 1 and lent >= 1 threads, got {base} and {lent}")
        self.busy, self.base, self.lent = busy, base, lent
        self.checks = 0  # layer passes (forward or backward) the trainer started
        self.borrowed = 0  # of which on the lent cores too
        self._handles: list = []

    def __deepcopy__(self, memo) -> CoreLending:
        # a copy of a hooked model (a reference model, a merged copy) shares this lending rather than
        # copying ``busy``'s controller with its locks and sockets; its hooks go quiet at ``remove``
        return self

    def adjust(self, *_) -> None:
        if not self._handles:  # removed: a copied model's hooks outlive the handles
            return
        n = self.base if self.busy() else self.base + self.lent
        self.checks += 1
        self.borrowed += n > self.base
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

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

    def take_share(self) -> float | None:
        """The share of layer passes since the last call that ran on the lent cores too (None: none ran)."""
        share = self.borrowed / self.checks if self.checks else None
        self.checks = self.borrowed = 0
        return share


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
