"""A run warns when its disk will not hold the checkpoints still to come."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from areal_core.run.checkpoints import disk_warning
from areal_core.storage import CheckpointStore
from areal_core.storage.config import StorageConfig
from areal_core.storage.writer import WriteResult

Usage = namedtuple("Usage", "total used free")
GB = 10**9


@pytest.fixture
def free_gb(monkeypatch):
    """Set the free space the store's disk reports, in GB."""
    state = {"free": 0.0}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * GB, 0, int(state["free"] * GB)))
    return lambda gb: state.update(free=gb)


def result(version: int, gb: float) -> WriteResult:
    return WriteResult(version, f"v{version}", "full", None, int(gb * GB), int(gb * GB) // 3, 1.0)


def test_warns_when_the_remaining_checkpoints_will_not_fit(tmp_path, free_gb):
    store, cfg = CheckpointStore(str(tmp_path)), StorageConfig(checkpoint_every=10)
    free_gb(5.0)
    # after v10 of 40 steps: v20, v30, v40 to come, 1.6 GB each = 4.8 GB, 5 GB free
    assert disk_warning(store, cfg, result(10, 1.6), max_steps=40) is None
    free_gb(4.0)
    line = disk_warning(store, cfg, result(10, 1.6), max_steps=40)
    assert "its 3 remaining checkpoints need about 4.8 GB" in line and "4.0 GB free" in line
    assert str(tmp_path) in line and "storage.keep_last" in line
    # the last step's checkpoint has nothing after it; after an extra one at step 25 come v35 and v40
    assert disk_warning(store, cfg, result(40, 1.6), max_steps=40) is None
    free_gb(3.0)
    assert "its 2 remaining" in disk_warning(store, cfg, result(25, 1.6), max_steps=40)


def test_with_keep_last_only_the_next_checkpoint_must_fit(tmp_path, free_gb):
    store, cfg = CheckpointStore(str(tmp_path)), StorageConfig(checkpoint_every=10, keep_last=2)
    free_gb(2.0)
    assert disk_warning(store, cfg, result(10, 1.6), max_steps=40) is None
    free_gb(1.0)
    line = disk_warning(store, cfg, result(10, 1.6), max_steps=40)
    assert "its next checkpoint needs about 1.6 GB" in line and "storage.keep_last" not in line


def test_small_sizes_read_in_megabytes(tmp_path, free_gb):
    free_gb(0.0001)
    line = disk_warning(CheckpointStore(str(tmp_path)), StorageConfig(), result(10, 0.006), max_steps=20)
    assert "(6 MB), its next checkpoint needs about 6 MB" in line and "has 0 MB free" in line


def test_remote_stores_v0_and_unknown_lengths_are_not_checked(tmp_path, free_gb):
    free_gb(0.0)
    cfg = StorageConfig()
    assert disk_warning(CheckpointStore(str(tmp_path)), cfg, result(10, 1.6), max_steps=None) is None
    assert disk_warning(CheckpointStore(str(tmp_path)), cfg, result(0, 1.6), max_steps=40) is None  # v0: no measure
    assert disk_warning(CheckpointStore("memory://bucket/run"), cfg, result(10, 1.6), max_steps=40) is None
