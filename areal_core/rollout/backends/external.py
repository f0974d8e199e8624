"""Servers someone else started that speak the embedded engine's protocol (``protocol.py``):
``rollout.backend: external`` with ``rollout.urls``. Nothing is started or stopped; on launch
every server is checked and loads the run's starting weights from the checkpoint store's URL
(``storage.url``: with s3:// the servers may be on any host that reaches the store). Their API
key comes from the config (``api_key_file`` / ``api_key_env``; ``allow_unauthenticated``: none)."""

from __future__ import annotations

import asyncio
import contextlib

from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.pool import RolloutPool


class ExternalBackend:
    name = "external"
    restartable = False
    reads_store_urls = True  # servers elsewhere read the starting version from the checkpoint store

    def __init__(self, urls: list[str], api_key: str | None = None):
        """``api_key``: the servers' (None: servers that take none, which the config must allow)."""
        if not urls:
            raise ValueError("rollout.backend: external needs rollout.urls (the servers' base URLs)")
        self.urls, self.api_key = list(urls), api_key

    @contextlib.contextmanager
    def launch(self, model_path: str, version: int):
        asyncio.run(self._load(model_path, version))
        yield list(self.urls)

    async def _load(self, model_path: str, version: int) -> None:
        pool = RolloutPool(self.urls, make_client=self.client)
        try:
            down = [u for u, ok in zip(self.urls, await pool.health()) if not ok]
            if down:
                raise RolloutServerError(
                    down[0],
                    None,
                    f"rollout server(s) {down} (rollout.urls) do not answer GET /health; start them first",
                )
            await pool.update_weights_from_disk(model_path, version)
        finally:
            await pool.aclose()

    def restart(self, index: int, model_path: str, version: int) -> None:
        raise RuntimeError(f"an external rollout server ({self.urls[index]}) cannot be restarted from here")

    def client(self, url: str, timeout_s: float = 600.0) -> EmbeddedClient:
        return EmbeddedClient(url, timeout_s, api_key=self.api_key)
