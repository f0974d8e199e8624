"""The embedded server's weight routes: loading a version from disk, from the trainer's shared
memory (``tensor`` transport) or from a process group's broadcasts (``distributed`` transport), and
reading a parameter back. A refused update (bad names, shapes or dtypes, an unreadable folder)
answers ``success: false`` with 400 and leaves the running weights in place."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from areal_core.rollout.backends.embedded.http_api import ApiError, engine_running, json_response, parse, parts
from areal_core.rollout.protocol import (
    InitWeightsGroupRequest,
    StatusResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromSharedMemoryRequest,
    UpdateWeightsRequest,
    WeightsByNameRequest,
)
from areal_core.rollout.weight_layout import TensorSpec

log = logging.getLogger("areal_core.rollout.backends.embedded.server")

_LOAD_FORMATS = (None, "auto", "safetensors")

router = APIRouter()


def _refused(version: int, source: str, e: Exception) -> Response:
    log.warning("weight update to version %d from %s refused: %s", version, source, e)
    return json_response(StatusResponse(success=False, message=f"cannot load weights: {e}"), status=400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    req = await parse(request, UpdateWeightsRequest)
    if req.load_format not in _LOAD_FORMATS:
        raise ApiError(400, f"load_format {req.load_format!r} is not supported (safetensors only)")
    engine = parts(request).engine
    t0 = time.perf_counter()
    with engine_running():
        try:
            if req.abort_all_requests:
                await asyncio.wrap_future(engine.abort_all())
            fut = await asyncio.to_thread(engine.update_weights, req.model_path, req.weight_version)
        except (OSError, ValueError) as e:
            return _refused(req.weight_version, req.model_path, e)
    await asyncio.wrap_future(fut)
    dt = time.perf_counter() - t0
    log.info("weights of version %d from %s loaded in %.2fs", req.weight_version, req.model_path, dt)
    return json_response(
        StatusResponse(success=True, message=f"weights of version {req.weight_version} loaded in {dt:.2f}s")
    )


async def _load(request: Request, req, read: Callable[[], dict[str, torch.Tensor]], source: str) -> Response:
    """Stage weights (``read()`` in a worker thread), then wait until the engine serves them."""
    engine = parts(request).engine
    t0 = time.perf_counter()
    with engine_running():
        try:
            if req.abort_all_requests:
                await asyncio.wrap_future(engine.abort_all())
            fut = await asyncio.to_thread(
                lambda: engine.update_weights_from_tensors(read(), req.weight_version, source)
            )
        except ValueError as e:
            return _refused(req.weight_version, source, e)
    await asyncio.wrap_future(fut)
    dt = time.perf_counter() - t0
    log.info("weights of version %d from %s live in %.3fs", req.weight_version, source, dt)
    return json_response(
        StatusResponse(success=True, message=f"weights of version {req.weight_version} loaded in {dt:.3f}s")
    )


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    req = await parse(request, UpdateWeightsFromSharedMemoryRequest)
    specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.offset) for t in req.tensors]
    shm = parts(request).shm
    return await _load(request, req, lambda: shm.tensors(req.shm_name, specs), f"shared memory {req.shm_name}")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    req = await parse(request, InitWeightsGroupRequest)
    try:
        await asyncio.to_thread(
            parts(request).receiver.init_group,
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
    except (ValueError, RuntimeError) as e:  # RuntimeError: the rendezvous failed or timed out
        return json_response(
            StatusResponse(success=False, message=f"cannot join group {req.group_name!r}: {e}"), status=400
        )
    return json_response(StatusResponse(success=True, message=f"joined {req.group_name} as rank {req.rank_offset}"))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    req = await parse(request, UpdateWeightsFromDistributedRequest)
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise ApiError(
            400,
            f"names ({len(req.names)}), dtypes ({len(req.dtypes)}) and shapes "
            f"({len(req.shapes)}) must have the same length",
        )
    specs = [TensorSpec(n, d, tuple(sh)) for n, d, sh in zip(req.names, req.dtypes, req.shapes)]
    for sp in specs:
        sp.torch_dtype  # noqa: B018 - an unknown dtype is a 400 before any broadcast is received
    receiver = parts(request).receiver
    return await _load(request, req, lambda: receiver.receive(req.group_name, specs), f"group {req.group_name}")


@router.post("/get_weights_by_name")
async def get_weights_by_name(request: Request):
    req = await parse(request, WeightsByNameRequest)
    p = dict(parts(request).engine.kv.model.named_parameters()).get(req.name)
    if p is None:
        raise ApiError(404, f"the model has no parameter {req.name!r}")
    return p.detach().flatten()[: req.truncate_size].float().tolist()
