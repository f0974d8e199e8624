"""A run's checkpoints: on the storage cadence, written in the background, reported when done.

The training thread decides (``due``), takes a consistent copy of the weights and the resume
state (``write``: the copy is cheap; the write runs on the writer's thread while training goes
on, and ``write`` blocks only while the previous write is still running), and hears about
finished writes at its next call (``poll``), so callbacks run on the training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from areal_core.storage import CheckpointStore
from areal_core.storage.config import StorageConfig, checkpoint_due
from areal_core.storage.snapshot import snapshot_model
from areal_core.storage.writer import CheckpointWriter, WriteResult


class RunCheckpoints:
    def __init__(self, store: CheckpointStore, cfg: StorageConfig, tokenizer, last_step: int,
                 on_written: Callable[[WriteResult], None]):
        """``last_step``: the step of the newest checkpoint already in ``store`` (0 for v0)."""
        self.cfg, self.tokenizer, self.on_written = cfg, tokenizer, on_written
        self.writer = CheckpointWriter.from_config(store, cfg)
        self.last_step, self.last_time = last_step, time.monotonic()
        self._pending: list[Future] = []
        self.written: list[dict] = []  # one row per finished write: version, format, bytes, seconds

    def due(self, step: int, final: bool) -> bool:
        return checkpoint_due(step, self.last_step, self.last_time, time.monotonic(), self.cfg, final=final)

    def write(self, step: int, model: torch.nn.Module, resume_files: dict[str, bytes], final: bool = False) -> float:
        """Queue checkpoint ``step`` (version = step; the final one full, whatever the format);
        returns how long it waited for the previous one."""
        tensors, files = snapshot_model(model, self.tokenizer)
        files.update(resume_files)
        self._pending.append(self.writer.submit(step, tensors, files, meta={"step": step}, full=final))
        self.last_step, self.last_time = step, time.monotonic()
        self.poll()
        return self.writer.last_wait_s

    def poll(self) -> None:
        """Report the writes that have finished (raising a failed write's error)."""
        while self._pending and self._pending[0].done():
            result = self._pending.pop(0).result()
            self.written.append({"version": result.version, "format": result.format, "bytes": result.bytes_written,
                                 "weight_bytes": result.weight_bytes, "write_s": round(result.write_s, 4),
                                 "done_at": result.done_at})
            self.on_written(result)

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Wait for the last write (also when the run failed: it is a consistent state), then
        report it; a failed write's error is raised, or noted on the run's own error."""
        self.writer.__exit__(exc_type, exc, tb)
        if exc is None:
            self.poll()
