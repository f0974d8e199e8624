"""Checkpoint streaming and small atomic-file helpers over fsspec (local or s3://).

The names below are imported on first use: the file helpers are needed by processes that never
touch a checkpoint (a Dask worker reading problem records), and the checkpoint modules import torch.
(``localize`` is not among them: its module has that name; import it from ``storage.localize``.)
"""

import importlib

_HOME = {
    "checkpoints": (
        "CheckpointError",
        "CheckpointStore",
        "CorruptCheckpointError",
        "ManifestError",
        "VersionExistsError",
        "VersionNotFoundError",
    ),
    "fsutil": (
        "ensure_bucket",
        "filesystem",
        "read_bytes",
        "read_json",
        "retry",
        "write_bytes_atomic",
        "write_json_atomic",
        "write_text_atomic",
    ),
    "snapshot": ("snapshot_model",),
    "writer": ("CheckpointWriteError", "CheckpointWriter", "WriteResult"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value
