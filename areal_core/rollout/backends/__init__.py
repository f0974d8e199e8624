"""Rollout backends: each one class with ``launch``, ``restart`` and ``client`` (the interface is
``areal_core/rollout/backend.py``), chosen by ``rollout.backend``."""

from __future__ import annotations

from pathlib import Path

from areal_core.rollout.backend import RolloutBackend


def make_backend(rollout, *, engine, log_dir: str | Path, api_key: str | None = None) -> RolloutBackend:
    """The backend ``rollout.backend`` configures (``rollout``: a ``RolloutConfig``; ``engine``:
    the embedded engine's ``EngineConfig``, from ``rollout.engine_config``). ``api_key``: the key
    the servers it starts require (the run's, ``auth.new_key``; None: one made for them); servers
    it is given by URL use the key the config names (``auth.ServerAuthConfig``)."""
    cfg = rollout.backend
    if cfg.kind == "embedded":
        from areal_core.rollout.backends.embedded.launcher import EmbeddedBackend

        return EmbeddedBackend(rollout.n_servers, engine, log_dir=log_dir, api_key=api_key)
    if cfg.kind == "external":
        from areal_core.rollout.backends.external import ExternalBackend

        return ExternalBackend(cfg.urls, api_key=cfg.resolve("the external rollout servers (rollout.backend.urls)"))
    if cfg.kind == "sglang":
        from areal_core.rollout.backends.sglang import SGLangBackend

        return SGLangBackend(cfg, log_dir=str(log_dir), weight_update=rollout.weight_update, api_key=api_key)
    if cfg.kind == "vllm":
        from areal_core.rollout.backends.vllm import VLLMBackend

        return VLLMBackend(
            cfg,
            weight_update=rollout.weight_update,
            seed=engine.seed,
            dtype=engine.dtype,
            log_dir=str(log_dir),
            api_key=api_key,
        )
    raise ValueError(f"unknown rollout.backend.kind {cfg.kind!r}")


def default_client(url: str, timeout_s: float):
    """A client for a server given by URL alone: the embedded server's (what a pool of servers without
    a backend's own client speaks to)."""
    from areal_core.rollout.backends.embedded.client import EmbeddedClient

    return EmbeddedClient(url, timeout_s)
