"""The HTTP plumbing every backend's client shares (``HTTPClient``), and its errors.

Each backend's client (``backends/embedded/client.py``, ``backends/sglang.py``, ``backends/vllm.py``)
is the only code that knows its server's paths and JSON; ``pool.py``'s ``RolloutPool`` spreads
generation over several servers.

Every request carries the server's API key as a bearer token (``auth.py``): the key given, or the
one this process started the server with (``auth.KEYRING``).

HTTP goes through aiohttp: the controller shares its process (and the GIL) with the trainer,
and httpx's connection pool cost a third of a core there at the quickstart's request rate
(docs/PERFORMANCE.md, "Where the asynchronous trainer's time went", 2026-11-24).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import aiohttp

from areal_core.rollout import auth

HEALTH = "/health"


CONNECTION_RETRIES = 4  # per request, for connection resets / refusals, with exponential backoff


async def wait_healthy(client, timeout_s: float, after: str = " of waiting") -> None:
    """Until ``client`` (any backend's) reports healthy; ``RolloutServerError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await client.health():
        if time.monotonic() > deadline:
            raise RolloutServerError(client.url, None, f"not healthy {timeout_s:.0f}s{after}")
        await asyncio.sleep(0.2)


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error (``status``), or could not be reached (``status`` None)."""

    def __init__(self, url: str, status: int | None, message: str, timed_out: bool = False):
        what = f"HTTP {status}" if status else ("no answer in time" if timed_out else "unreachable")
        super().__init__(f"rollout server {url}: {what}: {message}")
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

    def __init__(
        self, url: str, timeout_s: float = 600.0, retries: int = CONNECTION_RETRIES, api_key: str | None = None
    ):
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
                trust_env=False,
                headers=auth.bearer(self.api_key),
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
                if isinstance(e, asyncio.TimeoutError):
                    raise RolloutServerError(
                        self.url,
                        None,
                        f"{method} {path}: no answer within {self.timeout_s:g} s; a server that is slow rather "
                        "than stuck (many requests at once, a large model, bfloat16 on a CPU without bf16 units) "
                        "needs a longer request timeout (a run's rollout.request_timeout_s)",
                        timed_out=True,
                    ) from e
                if attempt == self.retries:
                    raise RolloutServerError(self.url, None, f"{method} {path}: {e!r}") from e
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
            raise RolloutServerError(
                self.url, 200, f"{method} {path}: answer is not JSON: {data[:200].decode('utf-8', 'replace')!r}"
            ) from None

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


async def run_all(coros) -> list:
    """Run all to the end; then raise the first error, if any."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
