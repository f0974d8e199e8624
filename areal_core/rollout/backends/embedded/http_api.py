"""What every route of the embedded server shares: reading and validating a body (size-limited),
answering JSON, the errors as ``{"message": ..., "error": {"message": ..., "type": ...}}``, and
the server's parts that routes reach through the app (:func:`parts`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_core.rollout.backends.embedded.engine import EngineStopped, RolloutEngine
from areal_core.rollout.backends.embedded.weight_receiver import DistributedReceiver, SharedMemoryReader

log = logging.getLogger("areal_core.rollout.backends.embedded.server")

MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ServerParts:
    """What the routes act on, kept on the app (``app.state.parts``)."""

    engine: RolloutEngine  # generates, and takes the weight updates
    shm: SharedMemoryReader  # reads the ``tensor`` transport's segments
    receiver: DistributedReceiver  # joins the ``distributed`` transport's groups
    numerics: dict  # this process's CPU kind, kernels and MKL mode, for /model_info


def parts(request: Request) -> ServerParts:
    return request.app.state.parts


class ApiError(Exception):
    """An answer other than 200, as JSON naming what is wrong."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Empty(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"message": message, "error": {"message": message, "type": kind}})


def json_response(model: pydantic.BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


@contextlib.contextmanager
def engine_running():
    """An engine that has stopped inside: 503, the server's state and not the request's (restartable)."""
    try:
        yield
    except EngineStopped as e:
        raise ApiError(503, str(e), "unavailable") from None


def _explain(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = f" (+{e.error_count() - 5} more)" if e.error_count() > 5 else ""
    return "invalid request body: " + "; ".join(parts) + more


async def body(request: Request) -> bytes:
    """The raw body, refused (413) past ``MAX_BODY_BYTES`` before it is all read."""
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


def validate(model: type[pydantic.BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise ApiError(400, _explain(e)) from None


async def parse(request: Request, model: type[pydantic.BaseModel], empty_ok: bool = False):
    """The body as ``model`` (400 naming each wrong field); ``empty_ok``: no body reads as ``{}``."""
    raw = await body(request)
    if empty_ok and not raw.strip():
        raw = b"{}"
    return validate(model, raw)


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered as JSON; an unexpected one is logged and the server stays up."""

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return error(e.status, e.message, e.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail), "http")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return error(400, f"invalid request: {e.errors()[:3]}", "invalid_request")

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.error("%s %s failed: %r", request.method, request.url.path, e)
        return error(500, f"internal error: {e!r}", "internal")
