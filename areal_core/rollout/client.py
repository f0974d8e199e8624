"""Async client of the embedded rollout servers: the only code that knows their HTTP paths and JSON.

It answers in the domain types of ``backend.py`` (:class:`Generation`), as every backend's
client does; the wire types of ``protocol.py`` stay in here and in the server.

``RolloutClient`` talks to one server; ``RolloutPool`` spreads generation over
several (each request goes to the server with the fewest requests in flight
from this pool) and broadcasts weight updates, pause and resume.

A request's own seed goes in its sampling params, under SGLang's name ``sampling_seed``.

Every request carries the server's API key as a bearer token (``auth.py``): the key given, or the
one this process started the server with (``auth.KEYRING``).

HTTP goes through aiohttp: the controller shares its process (and the GIL) with the trainer,
and httpx's connection pool cost a third of a core there at the quickstart's request rate
(docs/PERFORMANCE.md, "Where the asynchronous trainer's time went", 2026-11-24).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import aiohttp
import pydantic

from areal_core.rollout import auth
from areal_core.rollout.backend import Generation, Sampling, ServerInfo
from areal_core.rollout.protocol import (
    AbortRequest,
    GenerateBatchRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsGroupRequest,
    ModelInfo,
    RequestsSnapshot,
    SamplingParams,
    SharedTensor,
    StatusResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromSharedMemoryRequest,
    UpdateWeightsRequest,
    WeightsByNameRequest,
)

GENERATE = "/generate"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
UPDATE_WEIGHTS = "/update_weights_from_disk"
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"
INIT_GROUP = "/init_weights_update_group"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"
ABORT = "/abort_request"
HEALTH = "/health"
MODEL_INFO = "/get_model_info"
REQUESTS = "/get_requests"


CONNECTION_RETRIES = 4  # per request, for connection resets / refusals, with exponential backoff


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error (``status``), or could not be reached (``status`` None)."""

    def __init__(self, url: str, status: int | None, message: str, timed_out: bool = False):
        super().__init__(f"rollout server {url}: {'HTTP ' + str(status) if status else 'unreachable'}: {message}")
        self.url, self.status, self.message = url, status, message
        self.timed_out = timed_out  # no answer in time: the server may still be working on it

    @property
    def server_down(self) -> bool:
        """Unreachable, or its engine stopped (503): a restarted or other server can take the request."""
        return self.status in (None, 503)


def _server_message(body: bytes, reason: str) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:1000] or reason
    if isinstance(parsed, dict):
        err = parsed.get("error")
        for msg in (parsed.get("message"), err.get("message") if isinstance(err, dict) else err, parsed.get("detail")):
            if msg:
                return str(msg)
    return str(parsed)[:1000]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # servers are reached directly


def check_health_sync(url: str, timeout_s: float = 2.0) -> bool:
    """Blocking health probe, for code without an event loop (the launcher)."""
    try:
        with _NO_PROXY.open(url.rstrip("/") + HEALTH, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:  # refused, timed out, or a non-2xx answer (HTTPError < URLError < OSError)
        return False


class HTTPClient:
    """The HTTP plumbing every backend's client shares: one aiohttp session (made in the event
    loop that uses it), the server's API key on every request (``api_key``; None: the key this
    process started the server with, if any), connection failures retried with backoff, a non-2xx
    answer raised as :class:`RolloutServerError` with the server's own message, and ``GET /health``."""

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = CONNECTION_RETRIES,
                 api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries = timeout_s, retries
        self.api_key = api_key if api_key is not None else auth.key_for(self.url)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(self.timeout_s, 30.0)),
                # no cap on connections (one request per answer with some servers), and idle ones
                # closed well before the server does (SERVER_KEEP_ALIVE_S), so a request is never
                # sent on a socket the server is closing
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=20.0),
                trust_env=False, headers=auth.bearer(self.api_key),
            )
        return self._session

    async def _request(self, method: str, path: str, body: str | bytes | None = None) -> bytes:
        """The answer's body; ``body`` is JSON text. Connection-level failures (reset, refused,
        dropped) are retried; a timeout is not (the server may still be working on it)."""
        headers = None if body is None else {"content-type": "application/json"}
        for attempt in range(self.retries + 1):
            try:
                async with self._http().request(method, self.url + path, data=body, headers=headers) as resp:
                    data, status, reason = await resp.read(), resp.status, resp.reason
                break
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                timed_out = isinstance(e, asyncio.TimeoutError)
                if timed_out or attempt == self.retries:
                    raise RolloutServerError(self.url, None, f"{method} {path}: {e!r}", timed_out) from e
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        if not 200 <= status < 300:
            raise RolloutServerError(self.url, status, f"{method} {path}: {_server_message(data, reason or '')}")
        return data

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        """The JSON answer (None for an empty body) to a request with JSON ``body``."""
        data = await self._request(method, path, None if body is None else json.dumps(body))
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise RolloutServerError(self.url, 200, f"{method} {path}: answer is not JSON: "
                                                    f"{data[:200].decode('utf-8', 'replace')!r}") from None

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + HEALTH, timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class RolloutClient(HTTPClient):
    """One embedded server (implements backend.RolloutClient): ``RolloutClient(url, timeout_s,
    api_key=...)``."""

    async def _call(self, method: str, path: str, body: pydantic.BaseModel | None = None) -> bytes:
        return await self._request(method, path, None if body is None else body.model_dump_json())

    async def _status(self, path: str, body: pydantic.BaseModel | None = None) -> StatusResponse:
        st = StatusResponse.model_validate_json(await self._call("POST", path, body or _EMPTY))
        if not st.success:
            raise RolloutServerError(self.url, 200, st.message or f"{path} failed")
        return st

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: dict | Sampling | SamplingParams | None = None,
        rid: str | None = None,
    ) -> Generation:
        req = GenerateRequest(input_ids=[int(t) for t in input_ids], sampling_params=_sampling_params(sampling),
                              rid=rid)
        return to_generation(GenerateResponse.model_validate_json(await self._call("POST", GENERATE, req)))

    async def generate_batch(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling: dict | Sampling | SamplingParams | Sequence[dict | Sampling | SamplingParams] | None = None,
        rids: Sequence[str] | None = None,
    ) -> list[Generation]:
        """Several prompts in one request (they are admitted together); responses in order.
        ``sampling``: one for all prompts, or a list with one per prompt."""
        if isinstance(sampling, (list, tuple)):
            sp = [_sampling_params(s) for s in sampling]
        else:
            sp = _sampling_params(sampling)
        req = GenerateBatchRequest(input_ids=[[int(t) for t in ids] for ids in input_ids],
                                   sampling_params=sp, rid=list(rids) if rids is not None else None)
        return [to_generation(r) for r in _RESPONSES.validate_json(await self._call("POST", GENERATE, req))]

    async def pause(self) -> None:
        await self._status(PAUSE)

    async def resume(self) -> None:
        await self._status(CONTINUE)

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Returns once the server generates with the weights in ``model_path`` as ``version``."""
        await self._status(UPDATE_WEIGHTS, UpdateWeightsRequest(model_path=model_path, weight_version=version))

    async def update_weights_from_shared_memory(self, shm_name: str, specs, version: int) -> None:
        """Weights in a shared-memory segment on this host (``weight_layout.TensorSpec`` list)."""
        tensors = [SharedTensor(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset) for s in specs]
        await self._status(UPDATE_FROM_TENSOR, UpdateWeightsFromSharedMemoryRequest(
            shm_name=shm_name, tensors=tensors, weight_version=version))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        await self._status(INIT_GROUP, InitWeightsGroupRequest(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend))

    async def update_weights_from_distributed(self, specs, group_name: str, version: int) -> None:
        """Returns once the server received every tensor (broadcast by rank 0) and serves ``version``."""
        await self._status(UPDATE_FROM_DISTRIBUTED, UpdateWeightsFromDistributedRequest(
            names=[s.name for s in specs], dtypes=[s.dtype for s in specs], shapes=[list(s.shape) for s in specs],
            group_name=group_name, weight_version=version))

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of parameter ``name`` as the server holds it."""
        return json.loads(await self._call("POST", "/get_weights_by_name",
                                           WeightsByNameRequest(name=name, truncate_size=truncate_size)))

    async def abort_request(self, rid: str) -> None:
        """Stop request ``rid`` on the server (its output so far is returned to whoever waits for it)."""
        await self._status(ABORT, AbortRequest(rid=rid))

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server {self.url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(0.2)

    async def model_info(self) -> ModelInfo:
        """Everything the embedded server reports (``info`` is the part every backend has)."""
        return ModelInfo.model_validate_json(await self._call("GET", MODEL_INFO))

    async def weight_transports(self) -> list[str]:
        return (await self.model_info()).weight_transports

    async def info(self) -> ServerInfo:
        m = await self.model_info()
        return ServerInfo(weight_version=m.weight_version, running=m.running, waiting=m.waiting, paused=m.paused)

    async def requests(self) -> RequestsSnapshot:
        """Partial outputs of the unfinished requests (a protocol extension, see protocol.py)."""
        return RequestsSnapshot.model_validate_json(await self._call("GET", REQUESTS))

    async def partial_outputs(self) -> dict[str, Generation]:
        """What each unfinished request has generated so far, by request id."""
        return {p.rid: Generation(list(p.output_ids), list(p.output_token_logprobs), list(p.output_token_versions),
                                  "abort") for p in (await self.requests()).requests}


class _Empty(pydantic.BaseModel):
    pass


_RESPONSES = pydantic.TypeAdapter(list[GenerateResponse])


def _sampling_params(sampling: dict | Sampling | SamplingParams | None) -> SamplingParams:
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Sampling):
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_new_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
                              ignore_eos=sampling.ignore_eos, sampling_seed=sampling.seed)
    return SamplingParams.model_validate(sampling or {})


def to_generation(resp: GenerateResponse) -> Generation:
    meta = resp.meta_info
    if [t for _, t, _ in meta.output_token_logprobs] != resp.output_ids:
        raise ValueError(f"request {meta.id}: meta_info.output_token_logprobs does not follow output_ids")
    return Generation(output_ids=list(resp.output_ids), logprobs=[lp for lp, _, _ in meta.output_token_logprobs],
                      versions=list(meta.output_token_versions), finish_reason=meta.finish_reason.type)


_EMPTY = _Empty()


async def run_all(coros) -> list:
    """Run all to the end; then raise the first error, if any."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class RolloutPool:
    """``make_client(url, timeout_s)``: the backend's client (default: the embedded engine's).

    ``kv_budget_tokens``: a client-side KV-cache limit per server, for servers that do not enforce
    ``rollout.kv_budget`` themselves (external ones). A request reserves prompt (with what it
    generated so far) + max_new_tokens positions on the server it goes to until it returns; requests
    are admitted first come, first served (a later one never overtakes a waiting one), each to the
    least busy server it fits on, and one larger than the whole budget is a ``ValueError`` naming
    its size. Only this pool's requests are counted."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 600.0, make_client=None,
                 kv_budget_tokens: int | None = None):
        if not urls:
            raise ValueError("RolloutPool needs at least one server URL")
        if kv_budget_tokens is not None and kv_budget_tokens <= 0:
            raise ValueError(f"kv_budget_tokens must be positive, got {kv_budget_tokens}")
        self.clients = [(make_client or RolloutClient)(u, timeout_s) for u in urls]
        self.in_flight = [0] * len(self.clients)  # generate requests awaiting an answer, per server
        self.sent = [0] * len(self.clients)
        self._next = 0
        self.kv_budget_tokens = kv_budget_tokens
        self.kv_reserved = [0] * len(self.clients)  # KV positions reserved per server
        self.kv_peak = 0  # the most reserved on one server at once
        self.held = [0] * len(self.clients)  # > 0: out of service (being brought back), given no request
        self._queue: asyncio.Lock | None = None  # the head of the line (asyncio.Lock wakes in FIFO order)
        self._freed: asyncio.Condition | None = None  # KV released, or a server back in service

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

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
            raise ValueError(f"a request needing {need} KV positions (prompt + max_new_tokens) exceeds the whole "
                             f"rollout.kv_budget of {budget} tokens per server")

        def fits(j: int) -> bool:
            return not self.held[j] and (budget is None or self.kv_reserved[j] + need <= budget)

        n = len(self.clients)
        if budget is None and not any(self.held):
            return self._pick()  # the common case: no budget, every server in service
        if self._queue is None:  # made on the loop that uses them
            self._queue, self._freed = asyncio.Lock(), asyncio.Condition()
        async with self._queue:
            async with self._freed:
                await self._freed.wait_for(lambda: any(fits(j) for j in range(n)))
            i = self._pick(fits)
            if budget is not None:
                self.kv_reserved[i] += need
                self.kv_peak = max(self.kv_peak, self.kv_reserved[i])
            return i

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: dict | Sampling | SamplingParams | None = None,
        rid: str | None = None,
    ) -> Generation:
        need = len(input_ids) + _sampling_params(sampling).max_new_tokens if self.kv_budget_tokens else 0
        async with self._least_busy(1, need) as client:
            return await client.generate(input_ids, sampling, rid=rid)

    async def generate_batch(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling: dict | Sampling | SamplingParams | Sequence[dict | Sampling | SamplingParams] | None = None,
        rids: Sequence[str] | None = None,
    ) -> list[Generation]:
        """One batched request to one server (the least busy it fits on), responses in order."""
        need = 0
        if self.kv_budget_tokens:
            per = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(input_ids)
            sizes = [len(ids) + _sampling_params(x).max_new_tokens for ids, x in zip(input_ids, per, strict=True)]
            need = sum(sizes)
            if need > self.kv_budget_tokens and len(input_ids) > 1:  # too big together: one request each
                return list(await asyncio.gather(*(self.generate(ids, x, rid=rids[k] if rids else None)
                                                   for k, (ids, x) in enumerate(zip(input_ids, per)))))
        async with self._least_busy(len(input_ids), need) as client:
            return await client.generate_batch(input_ids, sampling, rids=rids)

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await run_all(c.update_weights_from_disk(model_path, version) for c in self.clients)

    async def pause(self) -> None:
        await run_all(c.pause() for c in self.clients)

    async def resume(self) -> None:
        await run_all(c.resume() for c in self.clients)

    async def health(self) -> list[bool]:
        return list(await asyncio.gather(*(c.health() for c in self.clients)))

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        await run_all(c.wait_healthy(timeout_s) for c in self.clients)

    async def model_infos(self) -> list[ModelInfo]:
        return await run_all(c.model_info() for c in self.clients)

    async def aclose(self) -> None:
        await run_all(c.aclose() for c in self.clients)
