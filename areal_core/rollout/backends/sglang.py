"""SGLang 0.5.x as a rollout backend: a launcher for ``python -m sglang.launch_server`` and a
client for its native HTTP API. Contract-tested only: SGLang needs CUDA, and this has never
run against a live SGLang server here (tests/sglang_standin.py is a stand-in for the contract).

Fields (read from SGLang's source: managers/io_struct.py, entrypoints/http_server.py,
managers/tokenizer_manager.py, utils/weight_versions.py, sampling/sampling_params.py):
``/generate`` takes ``input_ids`` (a list of lists for a batch, one response each, in order),
``sampling_params`` (one dict, or a list), ``return_logprob``, ``rid`` and answers
``output_ids`` plus ``meta_info``: ``finish_reason`` ``{"type": "stop", "matched"}`` |
``{"type": "length", "length"}`` | ``{"type": "abort", "message", ...}``;
``output_token_logprobs`` as ``[logprob, token_id, text|null]``; ``weight_version`` (a string
label) and ``weight_versions``: ``[{"version", "start", "end"}]`` over the output tokens, ``end``
exclusive, contiguous from 0. Versions are strings in SGLang: we send ``str(int)`` and start
servers with ``--weight-version <int>`` (its default label is ``"default"``). A server without
``weight_versions`` (older 0.5.x) gets its one ``weight_version`` for every token, which
over-reports freshness if an update happened mid-request. ``/abort_request`` aborts every
request whose rid *starts with* the given rid (answer ``...-s1`` is a prefix of ``...-s10``), so
the client sends each rid as ``wire_rid(rid)``, ``<length>:<rid>``: no such id is a prefix of
another, whatever the ids are.

``rollout.weight_update`` -> the SGLang pause mode the client wraps each weight update in
(pause, update, continue; ``SGLangClient(pause_mode=...)``):
  keep_kv   -> ``in_place``: requests stay put with their KV; update with ``flush_cache``
               false (SGLang refuses to flush while requests are held); ``/continue_generation``.
  reprefill -> ``retract``: requests go back to the queue and are re-prefilled with the new
               weights after ``/continue_generation``; or ``abort``: they return at once with
               finish ``abort`` and the caller resubmits ``prompt + output_ids``.
  drain     -> no pause: stop submitting, wait for in-flight requests, then update.
Weight transports: disk (``/update_weights_from_disk``) and distributed
(``/init_weights_update_group`` then ``/update_weights_from_distributed``, NCCL on GPUs).
SGLang's ``/update_weights_from_tensor`` passes CUDA IPC handles, so it only works on the
same GPU host; we do not implement it.

API key: servers the backend starts require the run's key (SGLang's ``--api-key``, given as
``api-key`` in a YAML file of mode 0600 passed with ``--config``, so the key is in no argv; SGLang
then answers 401 on everything but ``/health`` and ``/metrics`` without it); configured ``urls``
need ``api_key_file`` or ``api_key_env``, or ``allow_unauthenticated`` (auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from areal_core.rollout import auth
from areal_core.rollout.backend import (
    DEFAULT_WEIGHT_UPDATE,
    FinishReason,
    Generation,
    Sampling,
    ServerInfo,
    WeightUpdateMode,
    versions_from_spans,
)
from areal_core.rollout.backends.sglang_launch import check_reachable, sglang_launch_command, write_server_config
from areal_core.rollout.client import HTTPClient, RolloutServerError, check_health_sync
from areal_core.rollout.process import ServerProcess

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODE_FOR_UPDATE: dict[WeightUpdateMode, PauseMode | None] = {
    "keep_kv": "in_place",
    "reprefill": "retract",
    "drain": None,
}


class SGLangConfig(auth.ServerAuthConfig):
    """``rollout.backend: {kind: sglang, ...}``. ``urls``: use these servers (their key:
    ``api_key_file`` / ``api_key_env``, or ``allow_unauthenticated``); else start
    ``num_servers`` local ones on ``port``, ``port + port_stride``, ... (with more than one,
    server i sees GPUs i*tp_size.. via CUDA_VISIBLE_DEVICES), which require the run's key."""

    kind: Literal["sglang"] = "sglang"
    urls: list[str] = []  # running servers' base URLs to use; []: start num_servers here
    num_servers: int = Field(1, ge=1)  # servers to start (without urls)
    tp_size: int = Field(1, ge=1)  # GPUs per started server (SGLang's --tp-size)
    mem_fraction_static: float = Field(0.85, gt=0, le=1)  # GPU memory share for weights and KV cache (SGLang's)
    host: str = "127.0.0.1"  # the address started servers listen on, and the run reaches them at
    port: int = Field(30000, gt=0, lt=65536)  # the first started server's port
    port_stride: int = Field(10, ge=1)  # server i listens on port + i * port_stride
    extra_args: list[str] = []  # passed on to sglang.launch_server as they are
    env: dict[str, str] = {}  # environment variables set for started servers (over this process's)
    python: str = sys.executable  # the interpreter of the venv that has sglang
    startup_timeout_s: float = Field(900.0, gt=0)  # seconds a started server may take to answer /health
    connect_timeout_s: float = Field(10.0, gt=0)  # for configured urls, at start

    @model_validator(mode="after")
    def _key_or_consent(self):
        if self.urls and self.needs_key():
            raise ValueError(auth.UNAUTHENTICATED_MESSAGE.format(what="rollout.backend SGLang servers (urls)"))
        if not self.urls and (self.api_key_file or self.api_key_env or self.allow_unauthenticated):
            raise ValueError(
                "rollout.backend api_key_file, api_key_env and allow_unauthenticated are for "
                "configured urls; servers the run starts get the run's own key"
            )
        return self


def sampling_params(s: Sampling) -> dict[str, Any]:
    """``s`` as SGLang's ``sampling_params``: the one place a :class:`Sampling` becomes this
    backend's wire form (fields left at SGLang's defaults are not sent)."""
    sp: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
    }  # SGLang: -1 disables top-k
    if s.stop_token_ids:
        sp["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        sp["ignore_eos"] = True
    if s.seed is not None:
        sp["sampling_seed"] = s.seed
    return sp


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def wire_rid(rid: str) -> str:
    """The rid SGLang sees for ``rid``: ``<length>:<rid>``, a prefix-free code (two such ids with
    different lengths differ before the colon; with the same length, one is a prefix of the
    other only if they are equal), so SGLang's prefix-matching abort stops that request alone."""
    return f"{len(rid)}:{rid}"


def parse_generate_response(body: Any, url: str = "(response)") -> Generation:
    """One SGLang ``/generate`` answer -> Generation; a missing or malformed field raises
    RolloutServerError naming it."""

    def bad(field: str, why: str) -> RolloutServerError:
        return RolloutServerError(url, 200, f"malformed /generate response: {field} {why}")

    if not isinstance(body, dict):
        raise bad("body", f"must be an object, got {type(body).__name__}")
    ids, meta = body.get("output_ids"), body.get("meta_info")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise bad("output_ids", "is missing or not a list of token ids")
    if not isinstance(meta, dict):
        raise bad("meta_info", "is missing")
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in _FINISH:
        raise bad("meta_info.finish_reason", f"must be {{type: stop|length|abort}}, got {fr!r}")
    finish = _FINISH[fr["type"]]
    lps = meta.get("output_token_logprobs")
    if lps is None and not ids:
        lps = []  # e.g. aborted while waiting
    if not isinstance(lps, list):
        raise bad("meta_info.output_token_logprobs", "is missing (was return_logprob sent?)")
    if finish == "abort" and len(lps) > len(ids):
        lps = lps[: len(ids)]
    if len(lps) != len(ids):
        raise bad("meta_info.output_token_logprobs", f"has {len(lps)} entries for {len(ids)} output_ids")
    logprobs = []
    for i, (entry, tok) in enumerate(zip(lps, ids)):
        if not (
            isinstance(entry, (list, tuple))
            and len(entry) >= 2
            and isinstance(entry[0], (int, float))
            and entry[1] == tok
        ):
            raise bad(f"meta_info.output_token_logprobs[{i}]", f"must be [logprob, {tok}, text], got {entry!r}")
        logprobs.append(float(entry[0]))
    try:
        if meta.get("weight_versions") is not None:
            versions = versions_from_spans(meta["weight_versions"], len(ids))
        elif "weight_version" in meta:
            versions = [int(meta["weight_version"])] * len(ids)
        else:
            raise bad("meta_info.weight_version", "is missing (and no weight_versions)")
    except ValueError as e:
        raise bad("meta_info.weight_versions", f"unusable: {e} (integer labels need --weight-version <int>)") from e
    return Generation(output_ids=list(ids), logprobs=logprobs, versions=versions, finish_reason=finish)


class SGLangClient(HTTPClient):
    """One SGLang server (implements areal_core.rollout.backend.RolloutClient)."""

    TRANSPORTS = ("disk", "distributed")  # SGLang's tensor update passes CUDA IPC handles: not here

    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        pause_mode: PauseMode | None = "retract",
        retries: int = 2,
        api_key: str | None = None,
    ):
        """``pause_mode``: what an update does to in-flight requests (None: SGLang lets them finish
        first, our ``drain``); ``api_key``: the server's (sent as a bearer token)."""
        super().__init__(url, timeout_s, retries, api_key)
        self.pause_mode = pause_mode
        self._in_flight = 0
        self._paused = False

    async def _ok(self, path: str, body: dict) -> dict:
        ans = await self._json("POST", path, body)
        if not isinstance(ans, dict) or ans.get("success") is not True:
            raise RolloutServerError(self.url, 200, f"POST {path} failed: {ans!r}")
        return ans

    async def generate(self, input_ids: Sequence[int], sampling: Sampling, rid: str) -> Generation:
        body = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling_params(sampling),
            "return_logprob": True,
            "rid": wire_rid(rid),
        }
        self._in_flight += 1
        try:
            return parse_generate_response(await self._json("POST", "/generate", body), self.url)
        finally:
            self._in_flight -= 1

    async def generate_batch(
        self, input_ids: Sequence[Sequence[int]], sampling: Sequence[Sampling], rids: Sequence[str]
    ) -> list[Generation]:
        n = len(input_ids)
        if not n == len(sampling) == len(rids):
            raise ValueError(f"{n} prompts, {len(sampling)} sampling params, {len(rids)} rids")
        body = {
            "input_ids": [[int(t) for t in ids] for ids in input_ids],
            "sampling_params": [sampling_params(s) for s in sampling],
            "return_logprob": True,
            "rid": [wire_rid(r) for r in rids],
        }
        self._in_flight += n
        try:
            ans = await self._json("POST", "/generate", body)
        finally:
            self._in_flight -= n
        if not isinstance(ans, list) or len(ans) != n:
            raise RolloutServerError(
                self.url,
                200,
                f"malformed batched /generate response: expected a list of {n} responses, got {type(ans).__name__}",
            )
        return [parse_generate_response(a, self.url) for a in ans]

    async def abort_request(self, rid: str) -> None:
        await self._json("POST", "/abort_request", {"rid": wire_rid(rid)})

    async def pause(self) -> None:
        await self._json("POST", "/pause_generation", {"mode": self.pause_mode})
        self._paused = True

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", {})
        self._paused = False

    @contextlib.asynccontextmanager
    async def _paused_for_update(self):
        """Pause in ``pause_mode`` around an update unless the caller already paused."""
        if self._paused or self.pause_mode is None:
            yield
            return
        await self.pause()
        try:
            yield
        finally:
            await self.resume()

    async def weight_transports(self) -> list[str]:
        return list(self.TRANSPORTS)

    async def partial_outputs(self) -> dict[str, Generation]:
        """SGLang does not list a running request's tokens: a resumed run starts those answers again."""
        return {}

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        async with self._paused_for_update():
            await self._update_from_disk(model_path, version)

    async def _update_from_disk(self, model_path: str, version: int) -> None:
        await self._ok(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "weight_version": str(version),
                "abort_all_requests": False,
                "flush_cache": self.pause_mode != "in_place",
            },
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        await self._ok(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(self, specs, group_name: str, version: int) -> None:
        """The tensors ``specs`` (name, dtype, shape each) broadcast by the trainer (rank 0)."""
        names, dtypes, shapes = [s.name for s in specs], [s.dtype for s in specs], [list(s.shape) for s in specs]
        async with self._paused_for_update():
            await self._ok(
                "/update_weights_from_distributed",
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group_name,
                    "weight_version": str(version),
                    "abort_all_requests": False,
                    "flush_cache": self.pause_mode != "in_place",
                },
            )

    async def info(self) -> ServerInfo:
        """``running``: this client's requests awaiting an answer; SGLang's /model_info reports no
        load, so ``waiting`` is 0 and ``paused`` is what this client last asked for."""
        try:
            ans = await self._json("GET", "/model_info")
        except RolloutServerError as e:
            if e.status != 404:
                raise
            ans = await self._json("GET", "/get_model_info")  # before /model_info existed
        try:
            version = int(ans["weight_version"])
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutServerError(
                self.url,
                200,
                f"model_info.weight_version is not an integer label: "
                f"{ans!r} (start servers with --weight-version <int>)",
            ) from e
        return ServerInfo(weight_version=version, running=self._in_flight, waiting=0, paused=self._paused)


class SGLangBackend:
    """Starts SGLang servers as child processes (each its own process group, stopped by its PID),
    or uses the configured ``urls`` (which then load the run's weights from disk at launch);
    implements areal_core.rollout.backend.RolloutBackend."""

    name = "sglang"

    def __init__(
        self,
        cfg: SGLangConfig,
        log_dir: str | None = None,
        weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
        api_key: str | None = None,
    ):
        """``weight_update``: ``rollout.weight_update``, which picks the pause mode of each update;
        ``api_key``: what servers started here require (the run's; None: one made here)."""
        self.cfg = cfg
        self.pause_mode = PAUSE_MODE_FOR_UPDATE[weight_update]
        self.restartable = not cfg.urls
        self.reads_store_urls = False  # (SGLang loads a folder path its own host can read)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="sglang-logs-")
        self.api_key = (
            cfg.resolve("the SGLang servers in rollout.backend.urls") if cfg.urls else api_key or auth.new_key()
        )
        self._config_file: str | None = None  # while servers started here run: the file holding their key
        self.servers: dict[str, tuple[int, ServerProcess]] = {}  # url -> (index, process)
        self._model_path, self._version = "", 0

    @contextlib.contextmanager
    def launch(self, model_path: str, version: int) -> Iterator[list[str]]:
        if self.cfg.urls:
            urls = [u.rstrip("/") for u in self.cfg.urls]
            check_reachable(urls, self.cfg.connect_timeout_s)
            asyncio.run(self._load_all(urls, model_path, version))
            yield urls
            return
        self._model_path, self._version = model_path, version
        folder = tempfile.mkdtemp(prefix="sglang-config-")  # (mode 0700)
        try:
            self._config_file = write_server_config(folder, self.api_key)
            started = [self._start(i) for i in range(self.cfg.num_servers)]
            for s in started:
                self._wait_healthy(s)
            yield [s.url for s in started]
        finally:
            for _, proc in self.servers.values():
                proc.stop()
            self.servers.clear()
            shutil.rmtree(folder, ignore_errors=True)
            self._config_file = None

    def _start(self, i: int) -> ServerProcess:
        port = self.cfg.port + i * self.cfg.port_stride
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.cfg.num_servers > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * self.cfg.tp_size + k) for k in range(self.cfg.tp_size))
        env.update(self.cfg.env)
        log_path = os.path.join(self.log_dir, f"sglang-{i}.log")
        cmd = sglang_launch_command(self.cfg, self._model_path, port, self._version, self._config_file)
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        server = ServerProcess(proc, self.cfg.host, port, log_path, self.api_key)
        auth.remember(server.url, self.api_key)
        self.servers[server.url] = (i, server)
        return server

    def _wait_healthy(self, s: ServerProcess) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not check_health_sync(s.url, timeout_s=2.0):
            if not s.alive() or time.monotonic() > deadline:
                why = (
                    f"exited with code {s.returncode}"
                    if not s.alive()
                    else f"not healthy after {self.cfg.startup_timeout_s:.0f}s"
                )
                s.stop()
                raise RuntimeError(
                    f"SGLang server {s.url} (pid {s.pid}) {why}; tried GET {s.url}/health; "
                    f"log {s.log_path}:\n{s.log_tail()}"
                )
            time.sleep(0.5)

    async def _load_all(self, urls: list[str], model_path: str, version: int) -> None:
        clients = [self.client(u) for u in urls]
        try:
            await asyncio.gather(*(c.update_weights_from_disk(model_path, version) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    def restart(self, index: int, model_path: str, version: int) -> None:
        """Start server ``index`` again on its port from ``model_path`` as ``version`` (blocking)."""
        if not self.restartable:
            raise RuntimeError(f"a configured SGLang server ({self.cfg.urls[index]}) cannot be restarted from here")
        url = next((u for u, (i, _) in self.servers.items() if i == index), None)
        if url is None:
            raise RuntimeError(f"restart({index}): no SGLang server {index} was started by this backend")
        _, old = self.servers.pop(url)
        old.stop()
        self._model_path, self._version = model_path, version
        self._wait_healthy(self._start(index))

    def client(self, url: str, timeout_s: float = 600.0) -> SGLangClient:
        return SGLangClient(url, timeout_s, pause_mode=self.pause_mode, api_key=self.api_key)
