"""Keeping the rollout servers at the current weights: weight pushes, and bringing back a server
that failed a request, one at a time (the controller's loop runs all of it).

* **Pushes** (``push``) send the transport's staged version to every trainable server; a server
  that is down during a push is brought back instead.
* **Recovery** (``recover``): a server that failed a request is *held* out of its pool
  (``RolloutPool.hold``) at once, before anything else, and released only once it is up and holds
  the current weights. A restarted server starts from the latest checkpoint, which can be
  ``storage.checkpoint_every`` versions old, and it is idle, so the pool would otherwise pick it
  first and its tokens would be that stale. Held, it gets no request until the transport has given
  it the staged version (``resend``, which takes its turn on the transport's send buffer with the
  trainer's staging: it loads one version whole).
* **Frozen servers** (multi-agent runs) are restarted from their frozen checkpoint and never get
  weights from the transport.
* **Elastic pools** (``elastic``, servers this run cannot restart): a server that failed and does
  not answer its health check *leaves* the pool at once instead of being waited for (its answers
  continue elsewhere, ``generation.py``); a server that *joins* is held until it holds the staged
  version (or, before the first push, the latest checkpoint), then serves.

Guarantee: every token a trainable server samples carries a version at least the one the
staleness gate last confirmed, so the buffer's rule bounds every trained token's staleness by eta.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from areal_core.controller.settings import Restart
from areal_core.rollout.client import RolloutServerError, wait_healthy
from areal_core.rollout.pool import RolloutPool
from areal_core.rollout.weight_transport import TransportUnsupported, WeightTransport

log = logging.getLogger(__name__)


class ServerRecovery:
    """``restart(i, path, version)``: restart trainable server ``i`` (None: servers managed
    elsewhere, which are waited for); ``restart_source()`` gives the folder of ``model_version`` a
    restarted server starts from (``restart_from`` moves it on). ``restart_frozen`` and
    ``frozen_model_path``/``frozen_version``: the same for the frozen policy's servers."""

    def __init__(
        self,
        transport: WeightTransport,
        request_timeout_s: float,
        restart: Restart | None,
        model_path: str,
        model_version: int,
        restart_frozen: Restart | None = None,
        frozen_model_path: str = "",
        frozen_version: int = 0,
        elastic: bool = False,
    ):
        self.transport, self.request_timeout_s = transport, request_timeout_s
        self.restart, self.restart_frozen = restart, restart_frozen
        self.leaves = elastic and restart is None  # a dead server leaves the pool (else: restarted or waited for)
        self.left: list[str] = []  # the URLs of servers that left the pool, and of those that joined it
        self.joined: list[str] = []
        self.restart_source: Callable[[], str] = lambda: model_path
        self.model_version = model_version
        self.frozen_model_path, self.frozen_version = frozen_model_path, frozen_version
        self.trainable: RolloutPool | None = None
        self.frozen: RolloutPool | None = None

    def restart_from(self, local_copy: Callable[[], str], version: int) -> None:
        self.restart_source, self.model_version = local_copy, version

    def bind(self, trainable: RolloutPool, frozen: RolloutPool | None) -> None:
        """The pools, once made on the loop that uses them (the locks are made there too)."""
        self.trainable, self.frozen = trainable, frozen
        self._servers_lock = asyncio.Lock()  # weight updates and trainable recovery, one at a time
        self._frozen_lock = asyncio.Lock()  # (the trainable servers' updates go on meanwhile)

    async def connect(self) -> None:
        """Connect the transport; a version staged before the start (a LoRA run's adapters: its
        servers start from the base) reaches every server before anything is generated."""
        await self.transport.connect(self.trainable.live())
        if self.transport.staged_version is not None:
            async with self._servers_lock:
                await self.transport.push(self.trainable.live())

    async def push(self, version: int) -> None:
        """Every trainable server serves the staged ``version`` on return (the frozen ones: never)."""
        async with self._servers_lock:
            if self.transport.staged_version != version:
                raise RuntimeError(
                    f"update to version {version}, but the transport holds version {self.transport.staged_version}"
                )
            if not self.trainable.live():  # every server left an elastic pool: the run is stopping (elastic.py)
                return
            try:
                await self.transport.push(self.trainable.live())
            except (RolloutServerError, RuntimeError) as e:
                if self.leaves and await self._drop_dead():
                    if self.trainable.live():  # the servers left, at the staged version (none: the run stops)
                        await self.transport.push(self.trainable.live())
                    return
                if not isinstance(e, RolloutServerError) or not e.server_down:
                    raise
                log.warning("weight update of %s failed (%s); recovering the server", e.url, e)
                i = self.trainable.index(e.url)
                self.trainable.hold(i)
                try:
                    await self._bring_back(i)
                finally:
                    await self.trainable.release(i)

    async def recover(self, url: str, current: Callable[[], int]) -> None:
        """The trainable server at ``url`` failed a request: once this returns it is up and at the
        current weights (``current()``: the version the gate confirmed); until then it gets no request."""
        pool = self.trainable
        i = pool.index(url)
        pool.hold(i)  # now, before waiting for the lock: no request goes there meanwhile
        try:
            async with self._servers_lock:
                client = pool.clients[i]
                if pool.gone[i] or (await client.health() and (await client.info()).weight_version >= current()):
                    return  # left, or restarted meanwhile (or a passing failure)
                if self.leaves:
                    await self._drop_dead()
                    if pool.gone[i]:
                        return
                await self._bring_back(i)  # up, at older weights: it gets the staged version
        finally:
            await pool.release(i)

    async def _drop_dead(self) -> list[str]:
        """Elastic pools (caller holds the lock): the servers that do not answer their health check
        leave; the transport then serves those left. Returns the URLs that left."""
        pool = self.trainable
        dead = [i for i in range(len(pool.clients)) if not pool.gone[i]]
        for attempt in range(2):  # a busy server gets a second chance; a dead one fails both at once
            if attempt:
                await asyncio.sleep(1.0)
            alive = await asyncio.gather(*(pool.clients[i].health() for i in dead))
            dead = [i for i, ok in zip(dead, alive) if not ok]
        for i in dead:
            pool.leave(i)
            self.left.append(pool.clients[i].url)
            log.warning("rollout server %s is gone; it left the pool (%d left)", pool.clients[i].url, len(pool.live()))
        if dead:
            await self.transport.members_changed(pool.live())
        return [pool.clients[i].url for i in dead]

    async def join(self, client) -> bool:
        """Add the server of ``client`` to the trainable pool: it serves once it holds the current
        weights (the staged version; before the first push, the latest checkpoint). False (and a
        warning) if it could not be brought there, or quietly if it does not answer now (a URL still
        listed after its server died): it is then not part of the pool."""
        pool = self.trainable
        if not await client.health():
            await client.aclose()
            return False
        try:
            await wait_healthy(client, self.request_timeout_s, after=" after joining")
        except RolloutServerError as e:
            await client.aclose()
            log.warning("rollout server %s could not join: %s", client.url, e)
            return False
        # A member from the moment it joins the pool until the lock is let go, so a push never
        # sees it before the transport has made it one of its receivers (a weight-update group).
        async with self._servers_lock:
            i = pool.join(client)
            try:
                live = pool.live()
                if self.transport.staged_version is None:  # nothing newer than the checkpoint yet
                    path = await asyncio.to_thread(self.restart_source)
                    await client.update_weights_from_disk(path, self.model_version)
                    await self.transport.members_changed(live)
                else:
                    await self.transport.resend(live, live.index(client))
            except (RolloutServerError, TransportUnsupported, RuntimeError, OSError) as e:
                pool.leave(i)
                log.warning("rollout server %s could not join: %s", client.url, e)
                return False
            finally:
                await pool.release(i)
        self.joined.append(client.url)
        log.info("rollout server %s joined (%d in the pool)", client.url, len(pool.live()))
        return True

    async def _bring_back(self, i: int) -> None:
        """Restart server ``i`` from the last checkpoint (or wait for it to come back) and give it
        the transport's staged weights (caller holds the lock and holds ``i`` out of the pool)."""
        client = self.trainable.clients[i]
        if self.restart is not None:
            path = await asyncio.to_thread(self.restart_source)
            await asyncio.to_thread(self.restart, i, path, self.model_version)
        await wait_healthy(client, self.request_timeout_s, after=" after a restart")
        staged = self.transport.staged_version  # None: nothing newer than the checkpoint yet
        if staged is not None and (await client.info()).weight_version != staged:
            live = self.trainable.live()
            await self.transport.resend(live, live.index(client))

    async def recover_frozen(self, url: str) -> None:
        """A frozen server failed a request: make sure it is up, restarting it from the frozen
        checkpoint; it never gets weights from the transport."""
        pool = self.frozen
        i = pool.index(url)
        client = pool.clients[i]
        pool.hold(i)
        try:
            async with self._frozen_lock:
                if await client.health() and (await client.info()).weight_version == self.frozen_version:
                    return
                if self.restart_frozen is not None:
                    await asyncio.to_thread(self.restart_frozen, i, self.frozen_model_path, self.frozen_version)
                await wait_healthy(client, self.request_timeout_s, after=" after a restart")
        finally:
            await pool.release(i)
