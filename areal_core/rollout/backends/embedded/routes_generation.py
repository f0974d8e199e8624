"""The embedded server's generation routes: ``/generate`` (one prompt or a batch), pausing and
continuing generation, and aborting requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future

from fastapi import APIRouter, Request
from fastapi.responses import Response

from areal_core.rollout.backends.embedded.engine import RequestError
from areal_core.rollout.backends.embedded.http_api import (
    ApiError,
    Empty,
    body,
    engine_running,
    json_response,
    parse,
    parts,
    validate,
)
from areal_core.rollout.protocol import AbortRequest, GenerateBatchRequest, GenerateRequest, StatusResponse

router = APIRouter()


def _jobs(raw: bytes) -> tuple[list[tuple], bool, bool]:
    """The body's ``(input_ids, sampling, rid)`` jobs, whether it is a batch (``input_ids`` a list
    of lists), and whether it asks for logprobs."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None  # the model's validation names what is wrong
    ids = doc.get("input_ids") if isinstance(doc, dict) else None
    if isinstance(ids, list) and bool(ids) and isinstance(ids[0], list):
        batch = validate(GenerateBatchRequest, raw)
        rids = batch.rid or [None] * len(batch.input_ids)
        return list(zip(batch.input_ids, batch.per_prompt(), rids)), True, batch.return_logprob
    one = validate(GenerateRequest, raw)
    return [(one.input_ids, one.sampling_params, one.rid)], False, one.return_logprob


@router.post("/generate")
async def generate(request: Request):
    jobs, batched, return_logprob = _jobs(await body(request))
    try:
        with engine_running():
            futs = parts(request).engine.submit_many(jobs, return_logprob=return_logprob)
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    try:
        with engine_running():
            resps = [await asyncio.wrap_future(f) for f in futs]
    except RuntimeError as e:  # the engine failed this request (and logged why)
        raise ApiError(500, str(e), "engine") from None
    if not batched:
        return json_response(resps[0])
    return Response("[" + ",".join(r.model_dump_json() for r in resps) + "]", media_type="application/json")


async def _command(request: Request, make: Callable[[], Future], message: str) -> Response:
    await parse(request, Empty, empty_ok=True)
    with engine_running():
        await asyncio.wrap_future(make())
    return json_response(StatusResponse(success=True, message=message))


@router.post("/pause_generation")
async def pause_generation(request: Request):
    return await _command(request, parts(request).engine.pause, "generation paused")


@router.post("/continue_generation")
async def continue_generation(request: Request):
    return await _command(request, parts(request).engine.resume, "generation continued")


@router.post("/abort_request")
async def abort_request(request: Request):
    req = await parse(request, AbortRequest)
    if not req.abort_all and not req.rid:
        raise ApiError(400, "give a rid, or abort_all: true")
    engine = parts(request).engine
    with engine_running():
        if req.abort_all:
            await asyncio.wrap_future(engine.abort_all())
            return json_response(StatusResponse(success=True, message="every request aborted"))
        found = await asyncio.wrap_future(engine.abort_request(req.rid))
    return json_response(
        StatusResponse(success=True, message=f"request {req.rid} " + ("aborted" if found else "not found"))
    )
