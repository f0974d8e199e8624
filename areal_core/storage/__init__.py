"""Checkpoint streaming and small atomic-file helpers over fsspec (local or s3://)."""

from areal_core.storage.checkpoints import (
    CheckpointError,
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    VersionExistsError,
    VersionNotFoundError,
)
from areal_core.storage.fsutil import (
    ensure_bucket,
    filesystem,
    read_bytes,
    read_json,
    retry,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from areal_core.storage.localize import localize
from areal_core.storage.snapshot import snapshot_model
from areal_core.storage.writer import CheckpointWriteError, CheckpointWriter, WriteResult

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriteError",
    "CheckpointWriter",
    "CorruptCheckpointError",
    "ManifestError",
    "VersionExistsError",
    "VersionNotFoundError",
    "WriteResult",
    "ensure_bucket",
    "filesystem",
    "localize",
    "read_bytes",
    "read_json",
    "retry",
    "snapshot_model",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]
