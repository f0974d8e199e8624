"""The embedded rollout server: the engine behind a subset of SGLang's HTTP API.

    AREAL_ROLLOUT_API_KEY=<key> areal-flow rollout-server --model-path PATH_OR_URL --port N \\
        [--host 127.0.0.1] [--weight-version 0] [--parent-pid PID] [--allow-unauthenticated] \\
        [--engine-config '{"max_running": 256, "weight_update": "reprefill", "torch_threads": 1,
                           "dtype": "float32", "seed": 0, "kv_budget": {"tokens": 20000}}']
        (EngineConfig in config.py; omitted: defaults)

A run's launcher starts the same process as this module (``launcher.py``). Endpoints and bodies
are those of ``protocol.py``; the routes are grouped by concern in ``routes_generation.py``,
``routes_weights.py`` and ``routes_admin.py``, what they share in ``http_api.py``. Every request
but ``GET /health`` must carry the key from ``AREAL_ROLLOUT_API_KEY`` (taken out of the
environment at start, never on the command line) as ``Authorization: Bearer <key>``, else 401
(``auth.py``); without a key the server starts only with ``--allow-unauthenticated``. Bad input
gets a 4xx JSON answer ``{"message": ..., "error": {"message": ..., "type": ...}}`` naming the
problem; an engine failure fails only the requests it touched (500)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI

from areal_core.device import resolve_device
from areal_core.net import address_towards, free_port
from areal_core.numerics import cpu_kind
from areal_core.rollout.auth import API_KEY_ENV, BearerAuth
from areal_core.rollout.backends.embedded import routes_admin, routes_generation, routes_weights
from areal_core.rollout.backends.embedded.engine import EngineStopped, RolloutEngine
from areal_core.rollout.backends.embedded.http_api import ServerParts, add_error_handlers
from areal_core.rollout.backends.embedded.malloc import keep_freed_memory
from areal_core.rollout.backends.embedded.server_args import parse_args
from areal_core.rollout.backends.embedded.weight_receiver import DistributedReceiver, SharedMemoryReader
from areal_core.rollout.join_list import announce

SERVER_KEEP_ALIVE_S = 75  # idle keep-alive; clients expire theirs sooner (client.py)
log = logging.getLogger("areal_core.rollout.backends.embedded.server")


def create_app(engine: RolloutEngine, api_key: str | None = None) -> FastAPI:
    """The server's app; with ``api_key`` every path but ``/health`` needs it as a bearer token."""
    app = FastAPI(title="areal-flow rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    # broadcasts land where the engine computes (NCCL: its GPU)
    app.state.parts = ServerParts(engine, SharedMemoryReader(), DistributedReceiver(engine.device), cpu_kind())
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    add_error_handlers(app)
    for routes in (routes_generation, routes_weights, routes_admin):
        app.include_router(routes.router)
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


def main(argv: list[str] | None = None) -> None:
    serve(parse_args(argv))


def serve(args: argparse.Namespace) -> None:
    """Load the model and serve until stopped (a signal, or ``--parent-pid`` gone)."""
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
    if args.host_towards:
        args.host = address_towards(args.host_towards, 9)
    if args.port == 0:
        args.port = free_port(args.host)
    eng = args.engine_config
    torch.set_num_threads(eng.torch_threads)
    keep_freed_memory()  # each step's large tensors reuse the heap's pages (malloc.py)
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
    url = f"http://{args.host}:{args.port}"
    if args.announce:
        threading.Thread(
            target=_announce_once_up, args=(server, args.announce, url), name="announce", daemon=True
        ).start()
    try:
        server.run()
    finally:
        if args.announce:
            announce(args.announce, [url], present=False)
        engine.shutdown()
        log.info("stopped")


def _announce_once_up(server: _Server, join_list: str, url: str) -> None:
    """Add ``url`` to ``join_list`` once uvicorn accepts connections (what the run reads to take it in)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.2)
    announce(join_list, [url])
    log.info("announced %s in %s", url, join_list)


if __name__ == "__main__":
    main()
