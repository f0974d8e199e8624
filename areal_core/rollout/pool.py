"""``RolloutPool``: one policy's rollout servers as one, for any backend's client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from areal_core.rollout.backend import Generation, Sampling
from areal_core.rollout.client import run_all
from areal_core.rollout.protocol import ModelInfo


class RolloutPool:
    """``make_client(url, timeout_s)``: the backend's client (default: the embedded engine's).

    ``kv_budget_tokens``: a client-side KV-cache limit per server, for servers that do not enforce
    ``rollout.kv_budget`` themselves (external ones). A request reserves prompt (with what it
    generated so far) + max_new_tokens positions on the server it goes to until it returns; requests
    are admitted first come, first served (a later one never overtakes a waiting one), each to the
    least busy server it fits on, and one larger than the whole budget is a ``ValueError`` naming
    its size. Only this pool's requests are counted.

    Elastic pools: a server ``join``s (held out of service until it holds the current weights) and
    ``leave``s (it is gone: no request, no weights; its index stays, so indices never move)."""

    def __init__(self, urls: Sequence[str], make_client, timeout_s: float = 600.0, kv_budget_tokens: int | None = None):
        if not urls:
            raise ValueError("RolloutPool needs at least one server URL")
        if kv_budget_tokens is not None and kv_budget_tokens <= 0:
            raise ValueError(f"kv_budget_tokens must be positive, got {kv_budget_tokens}")
        self.clients = [make_client(u, timeout_s) for u in urls]
        self.in_flight = [0] * len(self.clients)  # generate requests awaiting an answer, per server
        self.sent = [0] * len(self.clients)
        self._next = 0
        self.kv_budget_tokens = kv_budget_tokens
        self.kv_reserved = [0] * len(self.clients)  # KV positions reserved per server
        self.kv_peak = 0  # the most reserved on one server at once
        self.held = [0] * len(self.clients)  # > 0: out of service (being brought back), given no request
        self.gone = [False] * len(self.clients)  # left the pool (``leave``): never used again
        self._queue: asyncio.Lock | None = None  # the head of the line (asyncio.Lock wakes in FIFO order)
        self._freed: asyncio.Condition | None = None  # KV released, or a server back in service

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def live(self) -> list:
        """The clients of the servers that have not left (in service or being brought back)."""
        return [c for c, gone in zip(self.clients, self.gone) if not gone]

    def index(self, url: str) -> int:
        """The index of the server at ``url`` that has not left (else its last one)."""
        found = [i for i, c in enumerate(self.clients) if c.url == url]
        if not found:
            raise ValueError(f"{url} is not a server of this pool")
        return next((i for i in reversed(found) if not self.gone[i]), found[-1])

    def join(self, client) -> int:
        """Add the server of ``client``, held out of service (``release`` it once it holds the
        current weights); returns its index."""
        self.clients.append(client)
        for counts in (self.in_flight, self.sent, self.kv_reserved):
            counts.append(0)
        self.held.append(1)
        self.gone.append(False)
        return len(self.clients) - 1

    def leave(self, i: int) -> None:
        """Server ``i`` is gone for good (preempted, host lost): it gets nothing from now on."""
        if not self.gone[i]:
            self.gone[i] = True
            self.held[i] += 1  # out of service for ever (the matching release never comes)

    def hold(self, i: int) -> None:
        """Give server ``i`` no new request until as many ``release(i)``: it failed, and is being
        brought back to the current weights (a restarted server is idle, so it would be picked
        first, with whatever old weights it started from). Requests already sent are not touched."""
        self.held[i] += 1

    async def release(self, i: int) -> None:
        self.held[i] -= 1
        if self.held[i] == 0 and self._freed is not None:
            async with self._freed:
                self._freed.notify_all()

    @contextlib.asynccontextmanager
    async def _least_busy(self, n: int, kv_tokens: int = 0):
        """The client of the server with the fewest requests in flight, among those in service,
        counting ``n`` more on it (and, with a budget, reserving ``kv_tokens`` KV positions there)."""
        i = await self._choose(kv_tokens)
        self.in_flight[i] += n
        self.sent[i] += n
        try:
            yield self.clients[i]
        finally:
            self.in_flight[i] -= n
            if self.kv_budget_tokens is not None:
                self.kv_reserved[i] -= kv_tokens
                async with self._freed:
                    self._freed.notify_all()

    def _pick(self, fits=lambda j: True) -> int:
        n = len(self.clients)
        order = [j for j in ((self._next + k) % n for k in range(n)) if fits(j)]  # ties rotate over the servers
        i = min(order, key=lambda j: self.in_flight[j])
        self._next = (i + 1) % n
        return i

    async def _choose(self, need: int) -> int:
        """Wait in line until a server in service has room for ``need`` KV positions (without a
        budget: until one is in service); reserve them there and return it."""
        budget = self.kv_budget_tokens
        if budget is not None and need > budget:
            raise ValueError(
                f"a request needing {need} KV positions (prompt + max_new_tokens) exceeds the whole "
                f"rollout.kv_budget of {budget} tokens per server"
            )

        def fits(j: int) -> bool:
            return not self.held[j] and (budget is None or self.kv_reserved[j] + need <= budget)

        if budget is None and not any(self.held):
            return self._pick()  # the common case: no budget, every server in service
        if self._queue is None:  # made on the loop that uses them
            self._queue, self._freed = asyncio.Lock(), asyncio.Condition()
        async with self._queue:
            async with self._freed:
                await self._freed.wait_for(lambda: any(fits(j) for j in range(len(self.clients))))
            i = self._pick(fits)
            if budget is not None:
                self.kv_reserved[i] += need
                self.kv_peak = max(self.kv_peak, self.kv_reserved[i])
            return i

    async def generate(self, input_ids: Sequence[int], sampling: Sampling, rid: str | None = None) -> Generation:
        need = len(input_ids) + sampling.max_new_tokens if self.kv_budget_tokens else 0
        async with self._least_busy(1, need) as client:
            return await client.generate(input_ids, sampling, rid=rid)

    async def generate_batch(
        self, input_ids: Sequence[Sequence[int]], sampling: Sequence[Sampling], rids: Sequence[str] | None = None
    ) -> list[Generation]:
        """One batched request to one server (the least busy it fits on), ``sampling`` one per prompt;
        responses in order."""
        need = 0
        if self.kv_budget_tokens:
            need = sum(len(ids) + s.max_new_tokens for ids, s in zip(input_ids, sampling, strict=True))
            if need > self.kv_budget_tokens and len(input_ids) > 1:  # too big together: one request each
                return list(
                    await asyncio.gather(
                        *(
                            self.generate(ids, s, rid=rids[k] if rids else None)
                            for k, (ids, s) in enumerate(zip(input_ids, sampling))
                        )
                    )
                )
        async with self._least_busy(len(input_ids), need) as client:
            return await client.generate_batch(input_ids, sampling, rids=rids)

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await run_all(c.update_weights_from_disk(model_path, version) for c in self.live())

    async def pause(self) -> None:
        await run_all(c.pause() for c in self.live())

    async def resume(self) -> None:
        await run_all(c.resume() for c in self.live())

    async def health(self) -> list[bool]:
        return list(await asyncio.gather(*(c.health() for c in self.live())))

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        await run_all(c.wait_healthy(timeout_s) for c in self.live())

    async def model_infos(self) -> list[ModelInfo]:
        return await run_all(c.model_info() for c in self.live())

    async def aclose(self) -> None:
        await run_all(c.aclose() for c in self.clients)
