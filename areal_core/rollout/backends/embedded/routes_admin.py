"""The embedded server's admin routes: health (open to probes), what it serves, and the partial
output of every unfinished request."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from areal_core.rollout.backends.embedded.http_api import engine_running, error, json_response, parts

TRANSPORTS = ["disk", "tensor", "distributed"]  # what this server can receive weights by

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not parts(request).engine.alive():
        return error(503, "the engine is not running", "unavailable")
    return {"status": "ok"}


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request):
    p = parts(request)
    return json_response(p.engine.info().model_copy(update={"weight_transports": TRANSPORTS, "numerics": p.numerics}))


@router.get("/get_requests")
async def get_requests(request: Request):
    with engine_running():
        return json_response(await asyncio.wrap_future(parts(request).engine.snapshot_requests()))
