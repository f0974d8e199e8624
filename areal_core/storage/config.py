from __future__ import annotations

from pydantic import Field

from areal_core.configbase import Section


class StorageConfig(Section):
    # where versions are published: a folder, file:// or s3:// URL. None: <run_dir>/checkpoints
    url: str | None = None
    keep_last: int | None = Field(None, gt=0)  # None: keep every version
    retries: int = Field(5, ge=0)  # per object write, with exponential backoff
    cache_dir: str | None = None  # local copies of remote versions; None: <run_dir>/.ckpt_cache
