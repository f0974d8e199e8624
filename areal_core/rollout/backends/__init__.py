"""Rollout backends: each one class with ``launch``, ``restart`` and ``client`` (the interface is
``areal_core/rollout/backend.py``), chosen by ``rollout.backend``."""

from __future__ import annotations

from pathlib import Path

from areal_core.rollout.backend import RolloutBackend


def make_backend(rollout, *, seed: int, dtype: str, log_dir: str | Path) -> RolloutBackend:
    """The backend ``rollout.backend`` names (``rollout``: a ``RolloutConfig``)."""
    if rollout.backend == "embedded":
        from areal_core.rollout.launcher import EmbeddedBackend

        return EmbeddedBackend(rollout, seed=seed, dtype=dtype, log_dir=log_dir)
    if rollout.backend == "external":
        from areal_core.rollout.backends.external import ExternalBackend

        return ExternalBackend(rollout.urls)
    raise ValueError(f"unknown rollout.backend {rollout.backend!r}")
