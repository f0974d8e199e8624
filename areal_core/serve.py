"""A pool of rollout servers kept up on its own, for training runs elsewhere to connect to.

``serve_rollout`` starts the servers a config's ``rollout.backend`` names (embedded, vLLM or
SGLang) on one model, hands their URLs to ``on_up`` (the Prefect flow publishes them), then checks
each server's health every ``check_every_s`` seconds, restarting a dead one where the backend can,
until ``hold_s`` has passed or ``should_stop()`` says so. Leaving stops every server it started.
A training run connects with ``rollout.backend: {kind: external | sglang, urls: [...]}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from areal_core.experiment import ExperimentConfig
from areal_core.models.loading import model_dtype
from areal_core.rollout.backends import make_backend
from areal_core.rollout.weight_layout import dtype_name

log = logging.getLogger(__name__)


async def _healthy(backend, urls: list[str]) -> list[bool]:
    async def one(url: str) -> bool:
        client = backend.client(url, timeout_s=10.0)
        try:
            return await client.health()
        finally:
            await client.aclose()
    return list(await asyncio.gather(*(one(u) for u in urls)))


def serve_rollout(cfg: ExperimentConfig, model_path: str, *, log_dir: str | Path, hold_s: float | None = None,
                  check_every_s: float = 30.0, version: int = 0,
                  on_up: Callable[[list[str]], None] = lambda urls: None,
                  on_check: Callable[[list[bool]], None] = lambda ok: None,
                  should_stop: Callable[[], bool] = lambda: False) -> dict:
    """Serve ``model_path`` (an HF folder or checkpoint version folder) for ``hold_s`` seconds after
    the servers are up (None: until ``should_stop``); returns the URLs, how long they were up and the
    restarts made."""
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(f"{model_path}: not a model folder (no config.json); give a checkpoint version "
                                "folder (RUN/checkpoints/vN) or an HF model folder")
    dtype = dtype_name(model_dtype(cfg.model)[0])
    engine = cfg.rollout.engine_config(seed=cfg.seed, dtype=dtype, device=cfg.model.device)
    backend = make_backend(cfg.rollout, engine=engine, log_dir=log_dir)
    restarts = 0
    with backend.launch(model_path, version) as urls:
        start = time.monotonic()  # hold_s counts from when the servers are up, not from the launch
        log.info("%d %s rollout server(s) up: %s", len(urls), backend.name, ", ".join(urls))
        on_up(list(urls))
        while not should_stop() and (hold_s is None or time.monotonic() - start < hold_s):
            wait = check_every_s if hold_s is None else min(check_every_s, hold_s - (time.monotonic() - start))
            deadline = time.monotonic() + max(0.0, wait)
            while time.monotonic() < deadline and not should_stop():
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            ok = asyncio.run(_healthy(backend, urls))
            on_check(ok)
            for index, up in enumerate(ok):
                if not up and backend.restartable:
                    log.warning("rollout server %s is down: restarting it", urls[index])
                    backend.restart(index, model_path, version)
                    restarts += 1
                elif not up:
                    log.warning("rollout server %s is down (the %s backend cannot restart it)", urls[index],
                                backend.name)
    return {"urls": list(urls), "backend": backend.name, "up_s": time.monotonic() - start, "restarts": restarts}
