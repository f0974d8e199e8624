from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_core.configbase import Section


class StorageConfig(Section):
    """The run's checkpoints (versioned model folders): where they are written, how often, in what form."""

    # where versions are published: a folder, file:// or s3:// URL. None: <run_dir>/checkpoints
    url: str | None = None
    keep_last: int | None = Field(None, gt=0)  # None: keep every checkpoint (a delta's base is always kept)
    retries: int = Field(5, ge=0)  # per object write, with exponential backoff
    cache_dir: str | None = None  # local copies of remote versions; None: <run_dir>/.ckpt_cache
    checkpoint_every: int = Field(10, ge=1)  # a checkpoint every N training steps (and at the final step)
    checkpoint_every_s: float | None = Field(None, gt=0)  # also one when this many seconds passed since the last
    format: Literal["full", "delta"] = "full"  # delta: weights stored as a compressed XOR against the last full
    full_every: int = Field(5, ge=1)  # with format delta: every full_every-th checkpoint is full


def checkpoint_due(
    step: int, last_step: int | None, last_time: float | None, now: float, cfg: StorageConfig, final: bool = False
) -> bool:
    """Whether training step ``step`` ends with a checkpoint.

    ``last_step`` / ``last_time``: the step and the time (same clock as ``now``) of the
    last checkpoint taken, None if none yet. Due at the final step, when none was taken
    yet, when ``checkpoint_every`` steps passed, or when ``checkpoint_every_s`` seconds
    passed; never twice for the same step."""
    if last_step is not None and step <= last_step:
        return False
    if final or last_step is None:
        return True
    if step - last_step >= cfg.checkpoint_every:
        return True
    return cfg.checkpoint_every_s is not None and last_time is not None and now - last_time >= cfg.checkpoint_every_s
