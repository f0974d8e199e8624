"""Checkpoints written in the background, one at a time, while training goes on.

    writer = CheckpointWriter.from_config(store, cfg.storage)
    tensors, files = snapshot_model(model, tokenizer)            # on the training thread
    files.update(run_state.encode(...))                          # resume state
    writer.submit(step, tensors, files, meta={"step": step})     # returns at once unless
    ...                                                          # the previous write still runs
    writer.close()                                               # waits for the last write

Each write stages the files locally (on the store's filesystem for a local store,
so they are then renamed into place; else under cache_dir and uploaded), then
publishes them with ``CheckpointStore.publish_folder``: manifest last, so a
checkpoint in progress is never visible and a writer killed mid-write leaves the
previous checkpoint the latest. With ``format="delta"`` the weights of every
checkpoint but each ``full_every``-th are a delta (``delta.py``) to the last full
one the writer wrote; the first checkpoint of a writer, and one submitted with
``full=True``, is always full. A LoRA run submits its adapters with their ``adapter_config``
instead of full weights: the version is then in the LoRA format (``adapters.py``), whatever
``format`` says.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from areal_core.storage import adapters, delta
from areal_core.storage.checkpoints import CheckpointError, CheckpointStore
from areal_core.storage.fsutil import FileData, write_local_file
from areal_core.storage.manifest import check_meta, check_version, path_problem
from areal_core.storage.snapshot import WEIGHTS, write_weights

log = logging.getLogger(__name__)
RESERVED_META = ("format", "base_version")
_STAGING = ".staging-"


class CheckpointWriteError(CheckpointError):
    """A background checkpoint write failed; raised at the next submit, flush or close."""


@dataclass(frozen=True)
class WriteResult:
    version: int
    url: str
    format: str  # "full", "delta" or "lora"
    base_version: int | None  # the full version a delta is made against
    bytes_written: int  # every file of the version, manifest excluded
    weight_bytes: int  # of which the weights (model.safetensors, model.delta or adapter.safetensors)
    write_s: float  # staging + publishing + pruning, on the writer thread
    pruned: list[int] = field(default_factory=list)
    done_at: float = 0.0  # time.monotonic() when it finished


class CheckpointWriter:
    """One checkpoint write at a time, on a background thread (see the module docstring)."""

    def __init__(
        self,
        store: CheckpointStore,
        format: str = "full",
        full_every: int = 5,
        keep_last: int | None = None,
        on_published: Callable[[WriteResult], None] | None = None,
        level: int = 1,
    ):
        if format not in ("full", "delta"):
            raise ValueError(f"format must be 'full' or 'delta', got {format!r}")
        if full_every < 1 or (keep_last is not None and keep_last < 1):
            raise ValueError(f"full_every ({full_every}) and keep_last ({keep_last}) must be >= 1")
        self.store, self.format, self.full_every, self.keep_last = store, format, full_every, keep_last
        self.on_published, self.level = on_published, level
        self.last_wait_s = 0.0  # how long the last submit blocked on the previous write
        self.total_wait_s = 0.0
        self._base: tuple[int, dict[str, torch.Tensor]] | None = None  # last full written: (version, tensors)
        self._since_full = 0  # deltas written since that full one
        self._pending: Future | None = None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
        self._staging_root = _remove_dead_staging(store)

    @classmethod
    def from_config(cls, store: CheckpointStore, cfg, on_published=None) -> CheckpointWriter:
        """From a ``StorageConfig`` (format, full_every, keep_last)."""
        return cls(
            store, format=cfg.format, full_every=cfg.full_every, keep_last=cfg.keep_last, on_published=on_published
        )

    # -- the caller's side ---------------------------------------------------
    def submit(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        files: dict[str, FileData],
        meta: dict | None = None,
        full: bool = False,
        adapter_config: dict | None = None,
    ) -> Future:
        """Queue checkpoint ``version``; returns a Future of its WriteResult.

        ``tensors``: CPU tensors the writer now owns (the caller must not mutate them),
        named as in model.safetensors; ``files``: every other file of the version
        ({relative path: ``fsutil.FileData``}: config, tokenizer, resume state; a callable one runs on
        the writer's thread, so what it writes must not change meanwhile). ``full``: write
        full weights even in delta format (e.g. the final checkpoint). Blocks while
        the previous write runs (``last_wait_s``); raises CheckpointWriteError if
        the previous write failed (this version is then not queued). ``adapter_config``: ``tensors``
        are a LoRA model's adapters (``lora.adapter_tensors``) and this their config; the version is
        written in the LoRA format against ``adapter_config["base_version"]``."""
        check_version(version)
        check_meta(meta)
        for key in RESERVED_META:
            if key in (meta or {}):
                raise ValueError(f"meta key {key!r} is set by the writer")
        for name in files:
            if path_problem(name) or name in (WEIGHTS, delta.DELTA, adapters.ADAPTER_FILE, adapters.ADAPTER_CONFIG):
                raise ValueError(f"file {name!r}: {path_problem(name) or 'the weights file name'}")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: expected a CPU torch.Tensor")
        pool = self._open_pool()
        t0 = time.perf_counter()
        self._wait()
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        self._pending = pool.submit(self._write, version, tensors, dict(files), dict(meta or {}), full, adapter_config)
        return self._pending

    def flush(self) -> WriteResult | None:
        """Wait for the write in flight; its result (None if none), or its error raised."""
        return self._wait()

    def close(self) -> WriteResult | None:
        """Flush, then stop the thread. Idempotent."""
        try:
            return self._wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            shutil.rmtree(self._staging_root, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointWriteError as err:  # keep the body's error; record the write's with it
            exc.add_note(f"and the checkpoint writer failed too: {err}")

    def _open_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise CheckpointError("the checkpoint writer is closed")
        return self._pool

    def _wait(self) -> WriteResult | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        err = pending.exception()
        if err is not None:
            raise CheckpointWriteError(f"checkpoint write to {self.store.url} failed: {err}") from err
        return pending.result()

    # -- the writer thread ---------------------------------------------------
    def _write(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        files: dict[str, FileData],
        meta: dict,
        full: bool,
        adapter_config: dict | None = None,
    ) -> WriteResult:
        t0 = time.perf_counter()
        as_delta = (
            self.format == "delta"
            and not full
            and self._base is not None
            and adapter_config is None
            and self._since_full < self.full_every - 1
        )
        stage = tempfile.mkdtemp(dir=self._staging_root, prefix=f"v{version}-")
        try:
            for name, data in files.items():
                write_local_file(os.path.join(stage, *name.split("/")), data)
            if adapter_config is not None:
                weights = adapters.write_adapters(tensors, adapter_config, stage)
                meta.update(format=adapters.FORMAT, base_version=adapter_config["base_version"])
            elif as_delta:
                base_version, base = self._base
                weights = os.path.join(stage, delta.DELTA)
                with open(weights, "wb") as f:
                    f.write(delta.encode(base_version, base, tensors, self.level))
                meta.update(format="delta", base_version=base_version)
            else:
                weights = os.path.join(stage, WEIGHTS)
                write_weights(tensors, weights)
                meta.update(format="full")
            weight_bytes = os.path.getsize(weights)
            total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(stage) for n in ns)
            url = self.store.publish_folder(version, stage, meta, move=True)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if as_delta:
            self._since_full += 1
        elif adapter_config is None:
            self._base, self._since_full = (version, tensors), 0
        pruned = self.store.prune(self.keep_last) if self.keep_last else []
        result = WriteResult(
            version,
            url,
            meta["format"],
            meta.get("base_version"),
            total,
            weight_bytes,
            time.perf_counter() - t0,
            pruned,
            time.monotonic(),
        )
        log.info("checkpoint v%d written (%s, %d bytes, %.2f s)", version, result.format, total, result.write_s)
        if self.on_published is not None:
            self.on_published(result)
        return result


def _remove_dead_staging(store: CheckpointStore) -> str:
    """This writer's staging folder (on the store's filesystem for a local store); staging
    folders left by writers that died (their pid is gone) are removed."""
    parent = store.root if store.is_local else (store.cache_dir or tempfile.gettempdir())
    os.makedirs(parent, exist_ok=True)
    for name in os.listdir(parent):
        if name.startswith(_STAGING):
            pid = name[len(_STAGING) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return tempfile.mkdtemp(dir=parent, prefix=f"{_STAGING}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
