"""A run's checkpoints: on the storage cadence, written in the background, reported when done.

The training thread decides (``due``), takes a consistent copy of the weights and the resume
state (``write``: the copy is cheap; the write runs on the writer's thread while training goes
on, and ``write`` blocks only while the previous write is still running), and hears about
finished writes at its next call (``poll``), so callbacks run on the training thread.

What a checkpoint holds is the trained model's to say (``trainer/published.py``): all its weights,
or the adapters against the base v0 where only adapters train; :func:`restore_weights` puts a
version back into the trainer's model either way.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from areal_core.storage import CheckpointStore
from areal_core.storage.config import StorageConfig, checkpoint_due
from areal_core.storage.writer import CheckpointWriter, WriteResult
from areal_core.trainer.published import published

log = logging.getLogger(__name__)


class RunCheckpoints:
    def __init__(
        self,
        store: CheckpointStore,
        cfg: StorageConfig,
        tokenizer,
        last_step: int,
        on_written: Callable[[WriteResult], None],
        max_steps: int | None = None,
    ):
        """``last_step``: the step of the newest checkpoint already in ``store`` (0 for v0);
        ``max_steps``: the run's last step (to warn early when the disk will not hold its checkpoints)."""
        self.cfg, self.tokenizer, self.on_written, self.max_steps = cfg, tokenizer, on_written, max_steps
        self.writer = CheckpointWriter.from_config(store, cfg)
        self.last_step, self.last_time = last_step, time.monotonic()
        self._pending: list[Future] = []
        self.written: list[dict] = []  # one row per finished write: version, format, bytes, seconds

    def due(self, step: int, final: bool) -> bool:
        return checkpoint_due(step, self.last_step, self.last_time, time.monotonic(), self.cfg, final=final)

    def write(self, step: int, model: torch.nn.Module, resume_files: dict[str, bytes], final: bool = False) -> float:
        """Queue checkpoint ``step`` (version = step; the final one full, whatever the format);
        returns how long it waited for the previous one."""
        parts = published(model).checkpoint(model, self.tokenizer)
        files = {**parts.files, **resume_files}
        self._pending.append(
            self.writer.submit(
                step, parts.tensors, files, meta={"step": step}, full=final, adapter_config=parts.adapter_config
            )
        )
        self.last_step, self.last_time = step, time.monotonic()
        self.poll()
        return self.writer.last_wait_s

    def poll(self) -> None:
        """Report the writes that have finished (raising a failed write's error)."""
        while self._pending and self._pending[0].done():
            result = self._pending.pop(0).result()
            self.written.append(
                {
                    "version": result.version,
                    "format": result.format,
                    "bytes": result.bytes_written,
                    "weight_bytes": result.weight_bytes,
                    "write_s": round(result.write_s, 4),
                    "done_at": result.done_at,
                }
            )
            self.on_written(result)
            warning = disk_warning(self.writer.store, self.cfg, result, self.max_steps)
            if warning:
                log.warning(warning)

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Wait for the last write (also when the run failed: it is a consistent state), then
        report it; a failed write's error is raised, or noted on the run's own error."""
        self.writer.__exit__(exc_type, exc, tb)
        if exc is None:
            self.poll()


def disk_warning(store: CheckpointStore, cfg: StorageConfig, result: WriteResult, max_steps: int | None) -> str | None:
    """A warning when a local store's disk will not hold the run's next checkpoints at the size of
    the one just written (all the rest of them, or with ``keep_last`` the next one, which is written
    before the oldest is pruned); None when it will, or the store is remote. v0 is not a measure: it
    has no resume state, and in a LoRA run it is the base where later versions hold adapters only."""
    if not store.is_local or max_steps is None or not 0 < result.version < max_steps:
        return None
    left = math.ceil((max_steps - result.version) / cfg.checkpoint_every) if cfg.keep_last is None else 1
    need, free = left * result.bytes_written, shutil.disk_usage(store.root).free
    if need <= free:
        return None
    what = f"its {left} remaining checkpoints need" if left > 1 else "its next checkpoint needs"
    return (
        f"checkpoints: at the size of v{result.version} ({_mb(result.bytes_written)}), {what} "
        f"about {_mb(need)} and {store.root} has {_mb(free)} free: free space"
        + (", or set storage.keep_last (only the newest N versions are kept)" if cfg.keep_last is None else "")
    )


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def restore_weights(store: CheckpointStore, model: torch.nn.Module, version: int) -> None:
    """Load checkpoint ``version`` into ``model``, as the model publishes itself (``trainer/published.py``)."""
    published(model).restore(store, model, version)
