"""A pool of rollout servers kept up on its own, for training runs elsewhere to connect to.

``serve_rollout`` starts the servers a config's ``rollout.backend`` names (embedded, vLLM or
SGLang) on one model, hands their URLs to ``on_up`` (the Prefect flow publishes them), then checks
each server's health every ``check_every_s`` seconds, restarting a dead one where the backend can,
until ``hold_s`` has passed or ``should_stop()`` says so. Leaving stops every server it started.
A training run connects with ``rollout.backend: {kind: external | sglang, urls: [...], api_key_file:
<log_dir>/rollout-api-key}``: the servers require a key made for the pool, which is written to that
file, readable by its owner alone (mode 0600), while they are up (``api_key_file`` in the result;
removed when they stop). A run on another machine copies the file there (or puts the key in an
environment variable it names with ``api_key_env``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from areal_core.experiment import ExperimentConfig
from areal_core.models.loading import servers_model_dtype
from areal_core.rollout.auth import new_key, write_private_file
from areal_core.rollout.backends import make_backend
from areal_core.rollout.weight_layout import dtype_name

log = logging.getLogger(__name__)

KEY_FILE = "rollout-api-key"  # in log_dir: the pool's API key, mode 0600


async def _healthy(backend, urls: list[str]) -> list[bool]:
    async def one(url: str) -> bool:
        client = backend.client(url, timeout_s=10.0)
        try:
            return await client.health()
        finally:
            await client.aclose()

    return list(await asyncio.gather(*(one(u) for u in urls)))


def serve_rollout(
    cfg: ExperimentConfig,
    model_path: str,
    *,
    log_dir: str | Path,
    hold_s: float | None = None,
    check_every_s: float = 30.0,
    version: int = 0,
    on_up: Callable[[list[str]], None] = lambda urls: None,
    on_check: Callable[[list[bool]], None] = lambda ok: None,
    should_stop: Callable[[], bool] = lambda: False,
    api_key: str | None = None,
) -> dict:
    """Serve ``model_path`` (an HF folder or checkpoint version folder) for ``hold_s`` seconds after
    the servers are up (None: until ``should_stop``); returns the URLs, the file holding their API key
    (``api_key_file``, None for servers given by URL: their key is the config's), how long they were
    up and the restarts made. ``api_key``: the key the servers require (a running run's, for servers
    that join it); None: one made for the pool."""
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path}: not a model folder (no config.json); give a checkpoint version "
            "folder (RUN/checkpoints/vN) or an HF model folder"
        )
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    dtype = dtype_name(servers_model_dtype(cfg.model)[0])
    engine = cfg.rollout.engine_config(seed=cfg.seed, dtype=dtype, device=cfg.model.device)
    backend = make_backend(cfg.rollout, engine=engine, log_dir=log_dir, api_key=api_key or new_key())
    restarts = 0
    started_here = not getattr(cfg.rollout.backend, "urls", None)  # (servers given by URL keep the config's key)
    key_file = Path(log_dir, KEY_FILE)
    with backend.launch(model_path, version) as urls:
        try:
            if started_here:
                write_private_file(str(key_file), backend.api_key)
            log.info(
                "%d %s rollout server(s) up: %s%s",
                len(urls),
                backend.name,
                ", ".join(urls),
                f" (API key in {key_file})" if started_here else "",
            )
            on_up(list(urls))
            start = time.monotonic()  # hold_s counts from when the URLs are handed out, not from the launch
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
                        log.warning(
                            "rollout server %s is down (the %s backend cannot restart it)", urls[index], backend.name
                        )
        finally:
            if started_here:
                key_file.unlink(missing_ok=True)  # the servers stop now, and their key goes with them
    return {
        "urls": list(urls),
        "backend": backend.name,
        "api_key_file": str(key_file) if started_here else None,
        "up_s": time.monotonic() - start,
        "restarts": restarts,
    }
