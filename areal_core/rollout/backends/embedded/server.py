"""The embedded rollout server: the engine behind a subset of SGLang's HTTP API.

    AREAL_ROLLOUT_API_KEY=<key> python -m areal_core.rollout.backends.embedded.server --model-path PATH_OR_URL --port N \\
        [--host 127.0.0.1] [--weight-version 0] [--parent-pid PID] [--allow-unauthenticated] \\
        [--engine-config '{"max_running": 256, "weight_update": "reprefill", "torch_threads": 1,
                           "dtype": "float32", "seed": 0, "kv_budget": {"tokens": 20000}}']
        (EngineConfig in config.py; omitted: defaults)

Endpoints and bodies are those of ``protocol.py``. Every request but ``GET /health`` must carry
the key from ``AREAL_ROLLOUT_API_KEY`` (taken out of the environment at start, never on the command
line) as ``Authorization: Bearer <key>``, else 401 (``auth.py``); without a key the server starts
only with ``--allow-unauthenticated``. Bad input gets a 4xx JSON answer ``{"message": ..., "error":
{"message": ..., "type": ...}}`` naming the problem; an engine failure fails only the requests it
touched (500)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time

import pydantic
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_core.device import resolve_device
from areal_core.numerics import cpu_kind
from areal_core.rollout.auth import API_KEY_ENV, BearerAuth
from areal_core.rollout.backends.embedded.engine import EngineStopped, RequestError, RolloutEngine
from areal_core.rollout.backends.embedded.malloc import keep_freed_memory
from areal_core.rollout.backends.embedded.weight_receiver import DistributedReceiver, SharedMemoryReader
from areal_core.rollout.config import EngineConfig
from areal_core.rollout.protocol import (
    AbortRequest,
    GenerateBatchRequest,
    GenerateRequest,
    InitWeightsGroupRequest,
    StatusResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromSharedMemoryRequest,
    UpdateWeightsRequest,
    WeightsByNameRequest,
)
from areal_core.rollout.weight_layout import TensorSpec

TRANSPORTS = ["disk", "tensor", "distributed"]  # what this server can receive weights by
SERVER_KEEP_ALIVE_S = 75  # idle keep-alive; clients expire theirs sooner (client.py)
log = logging.getLogger("areal_core.rollout.backends.embedded.server")

MAX_BODY_BYTES = 8 << 20
_LOAD_FORMATS = (None, "auto", "safetensors")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Empty(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"message": message, "error": {"message": message, "type": kind}})


def _explain(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = f" (+{e.error_count() - 5} more)" if e.error_count() > 5 else ""
    return "invalid request body: " + "; ".join(parts) + more


async def _body(request: Request) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[pydantic.BaseModel], empty_ok: bool = False):
    raw = await _body(request)
    if empty_ok and not raw.strip():
        raw = b"{}"
    return _validate(model, raw)


def _validate(model: type[pydantic.BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise ApiError(400, _explain(e)) from None


def _json(model: pydantic.BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def create_app(engine: RolloutEngine, api_key: str | None = None) -> FastAPI:
    """The server's app; with ``api_key`` every path but ``/health`` needs it as a bearer token."""
    shm = SharedMemoryReader()
    receiver = DistributedReceiver(engine.device)  # broadcasts land where the engine computes (NCCL: its GPU)
    app = FastAPI(title="areal-flow rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.weight_receiver = receiver
    numerics = cpu_kind()  # this process's kernels and MKL mode, for /model_info
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return _error(e.status, e.message, e.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "http")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return _error(400, f"invalid request: {e.errors()[:3]}", "invalid_request")

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):  # logged, answered as JSON; the server stays up
        log.error("%s %s failed: %r", request.method, request.url.path, e)
        return _error(500, f"internal error: {e!r}", "internal")

    @app.post("/generate")
    async def generate(request: Request):
        raw = await _body(request)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the model's validation names what is wrong
        ids = body.get("input_ids") if isinstance(body, dict) else None
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        if batched:
            req = _validate(GenerateBatchRequest, raw)
            rids = req.rid or [None] * len(req.input_ids)
            jobs = list(zip(req.input_ids, req.per_prompt(), rids))
        else:
            req = _validate(GenerateRequest, raw)
            jobs = [(req.input_ids, req.sampling_params, req.rid)]
        try:
            futs = engine.submit_many(jobs, return_logprob=req.return_logprob)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None
        try:
            resps = [await asyncio.wrap_future(f) for f in futs]
        except EngineStopped as e:  # the server, not the request: restartable
            raise ApiError(503, str(e), "unavailable") from None
        except RuntimeError as e:  # the engine failed this request (and logged why)
            raise ApiError(500, str(e), "engine") from None
        if not batched:
            return _json(resps[0])
        return Response("[" + ",".join(r.model_dump_json() for r in resps) + "]", media_type="application/json")

    async def _command(request: Request, make, message: str):
        await _parse(request, _Empty, empty_ok=True)
        try:
            await asyncio.wrap_future(make())
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None
        return _json(StatusResponse(success=True, message=message))

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        return await _command(request, engine.pause, "generation paused")

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        return await _command(request, engine.resume, "generation continued")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await _parse(request, UpdateWeightsRequest)
        if req.load_format not in _LOAD_FORMATS:
            raise ApiError(400, f"load_format {req.load_format!r} is not supported (safetensors only)")
        t0 = time.perf_counter()
        try:
            if req.abort_all_requests:
                await asyncio.wrap_future(engine.abort_all())
            fut = await asyncio.to_thread(engine.update_weights, req.model_path, req.weight_version)
        except (OSError, ValueError) as e:
            log.warning("weight update to version %d from %s refused: %s", req.weight_version, req.model_path, e)
            return _json(StatusResponse(success=False, message=f"cannot load weights: {e}"), status=400)
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None
        await asyncio.wrap_future(fut)
        dt = time.perf_counter() - t0
        log.info("weights of version %d from %s loaded in %.2fs", req.weight_version, req.model_path, dt)
        return _json(
            StatusResponse(success=True, message=f"weights of version {req.weight_version} loaded in {dt:.2f}s")
        )

    async def _load(req, read, source: str):
        """Stage weights (``read()`` in a worker thread), then wait until the engine serves them."""
        t0 = time.perf_counter()
        try:
            if req.abort_all_requests:
                await asyncio.wrap_future(engine.abort_all())
            fut = await asyncio.to_thread(
                lambda: engine.update_weights_from_tensors(read(), req.weight_version, source)
            )
        except ValueError as e:
            log.warning("weight update to version %d from %s refused: %s", req.weight_version, source, e)
            return _json(StatusResponse(success=False, message=f"cannot load weights: {e}"), status=400)
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None
        await asyncio.wrap_future(fut)
        dt = time.perf_counter() - t0
        log.info("weights of version %d from %s live in %.3fs", req.weight_version, source, dt)
        return _json(
            StatusResponse(success=True, message=f"weights of version {req.weight_version} loaded in {dt:.3f}s")
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        req = await _parse(request, UpdateWeightsFromSharedMemoryRequest)
        specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.offset) for t in req.tensors]
        return await _load(req, lambda: shm.tensors(req.shm_name, specs), f"shared memory {req.shm_name}")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        req = await _parse(request, InitWeightsGroupRequest)
        try:
            await asyncio.to_thread(
                receiver.init_group,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                req.group_name,
                req.backend,
            )
        except (ValueError, RuntimeError) as e:  # RuntimeError: the rendezvous failed or timed out
            return _json(
                StatusResponse(success=False, message=f"cannot join group {req.group_name!r}: {e}"), status=400
            )
        return _json(StatusResponse(success=True, message=f"joined {req.group_name} as rank {req.rank_offset}"))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        req = await _parse(request, UpdateWeightsFromDistributedRequest)
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise ApiError(
                400,
                f"names ({len(req.names)}), dtypes ({len(req.dtypes)}) and shapes "
                f"({len(req.shapes)}) must have the same length",
            )
        specs = [TensorSpec(n, d, tuple(sh)) for n, d, sh in zip(req.names, req.dtypes, req.shapes)]
        for sp in specs:
            sp.torch_dtype  # noqa: B018 - an unknown dtype is a 400 before any broadcast is received
        return await _load(req, lambda: receiver.receive(req.group_name, specs), f"group {req.group_name}")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = await _parse(request, AbortRequest)
        if not req.abort_all and not req.rid:
            raise ApiError(400, "give a rid, or abort_all: true")
        try:
            if req.abort_all:
                await asyncio.wrap_future(engine.abort_all())
                return _json(StatusResponse(success=True, message="every request aborted"))
            found = await asyncio.wrap_future(engine.abort_request(req.rid))
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None
        return _json(
            StatusResponse(success=True, message=f"request {req.rid} " + ("aborted" if found else "not found"))
        )

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request):
        req = await _parse(request, WeightsByNameRequest)
        p = dict(engine.kv.model.named_parameters()).get(req.name)
        if p is None:
            raise ApiError(404, f"the model has no parameter {req.name!r}")
        return p.detach().flatten()[: req.truncate_size].float().tolist()

    @app.get("/health")
    async def health():
        if not engine.alive():
            return _error(503, "the engine is not running", "unavailable")
        return {"status": "ok"}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        return _json(engine.info().model_copy(update={"weight_transports": TRANSPORTS, "numerics": numerics}))

    @app.get("/get_requests")
    async def get_requests():
        try:
            return _json(await asyncio.wrap_future(engine.snapshot_requests()))
        except EngineStopped as e:
            raise ApiError(503, str(e), "unavailable") from None

    return app


class _Server(uvicorn.Server):
    """Aborts in-flight generation on the first exit signal so connections close at once."""

    engine: RolloutEngine | None = None

    def abort_generation(self) -> None:
        if self.engine is not None:
            try:
                self.engine.abort_all()
            except EngineStopped:
                pass

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:  # no locks in a signal handler: abort from a helper thread
            threading.Thread(target=self.abort_generation, name="abort-on-exit", daemon=True).start()
        super().handle_exit(sig, frame)


def _watch_parent(parent_pid: int, server: _Server) -> None:
    """Exit when the process that started us is gone (we were re-parented)."""
    while not server.should_exit:
        if os.getppid() != parent_pid:
            log.warning("parent process %d is gone; shutting down", parent_pid)
            server.abort_generation()
            server.should_exit = True
            return
        time.sleep(1.0)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _engine_config(text: str) -> EngineConfig:
    try:
        return EngineConfig.model_validate_json(text)
    except pydantic.ValidationError as e:
        raise argparse.ArgumentTypeError(
            "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        ) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m areal_core.rollout.backends.embedded.server", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--model-path", required=True, help="Hugging Face model folder or fsspec URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--weight-version", type=int, default=0)
    ap.add_argument(
        "--engine-config",
        type=_engine_config,
        default=EngineConfig(),
        help="the engine's settings as JSON (EngineConfig in areal_core/rollout/config.py)",
    )
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    ap.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help=f"serve without a key when {API_KEY_ENV} is not set (any local process can then drive it)",
    )
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s rollout[%(process)d]: %(message)s",
    )
    api_key = os.environ.pop(API_KEY_ENV, "") or None  # (not left for anything this process starts)
    if api_key is None and not args.allow_unauthenticated:
        sys.exit(
            f"error: no API key: set {API_KEY_ENV} in the server's environment, or pass "
            "--allow-unauthenticated to serve without one"
        )
    if api_key is None:
        log.warning(
            "serving without an API key (--allow-unauthenticated): any process that can reach "
            "this port can generate, pause generation and load weights"
        )
    eng = args.engine_config
    torch.set_num_threads(eng.torch_threads)
    keep_freed_memory()  # each step's large tensors reuse the heap's pages (malloc.py)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    engine = RolloutEngine.from_pretrained(
        args.model_path,
        dtype=_DTYPES[eng.dtype],
        device=resolve_device(eng.device),
        max_running=eng.max_running,
        weight_update=eng.weight_update,
        weight_version=args.weight_version,
        seed=eng.seed,
        kv_budget=eng.kv_budget,
        batch_invariant=eng.batch_invariant,
        weight_hashes=eng.weight_hashes,
    )
    log.info(
        "model %s (version %d) loaded in %.1fs; serving on http://%s:%d (%s)",
        args.model_path,
        args.weight_version,
        time.perf_counter() - t0,
        args.host,
        args.port,
        eng.model_dump_json(),
    )
    config = uvicorn.Config(
        create_app(engine, api_key),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="off",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )
    server = _Server(config)
    server.engine = engine
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, server), name="parent-watch", daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
        log.info("stopped")


if __name__ == "__main__":
    main()
