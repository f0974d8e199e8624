"""The OpenAI wire format, and nothing else: a local HTTP endpoint that the official ``openai``
client talks to (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``).

Each conversation has its own base URL, ``http://127.0.0.1:PORT/c/<conversation>/v1``, and API
key (the plain ``/v1`` also works: the key names the conversation). Every request carries a bearer
token (``Authorization: Bearer <key>``) that ``authorize(token, conversation)`` (the episode)
accepts: the run's secret or that conversation's key; a missing or wrong one is answered 401, on
every path, before anything else. A request is checked and turned into a :class:`Call`;
``handle(conversation, call)`` (the ``openai_agent`` episode) generates and returns a
:class:`Reply`, which goes back as an OpenAI-shaped JSON body. Anything wrong with a request is
answered 4xx as ``{"error": {"message", "type", "param", "code"}}``, as OpenAI does, so the client
raises ``BadRequestError`` / ``NotFoundError`` / ``AuthenticationError`` with the message.

Supported: one choice (``n`` 1), no streaming, ``max_tokens`` / ``max_completion_tokens``,
``stop``; a completion's ``prompt`` is text. Sampling parameters (``temperature``, ``top_p``,
``seed``, ...) are accepted and ignored: the policy samples with the run's settings, which the
trainer's behaviour logprobs assume. ``logprobs`` are not returned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_STOPS = 4  # as OpenAI


class ProxyError(Exception):
    """A request the endpoint refuses: answered with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


@dataclass
class Call:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    model: str
    prompt: str = ""
    messages: list[dict] | None = None  # each with a text "content"
    tools: list | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


def _bad(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


def _text(content, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}: only text content is supported (a string or a list of text parts)", where)


def parse_call(body, chat: bool) -> Call:
    """Check a request body and keep what generation needs."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is a required property (any name: the policy answers)", "model")
    if body.get("stream"):
        raise _bad("streaming is not supported by this endpoint; call without stream=True", "stream")
    if body.get("n") not in (None, 1):
        raise _bad(f"n={body.get('n')!r}: one choice per call only (each conversation is one trajectory)", "n")
    if body.get("echo") or body.get("best_of") not in (None, 1):
        raise _bad("echo and best_of are not supported", "echo")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    call = Call(chat=chat, model=model, max_tokens=max_tokens, stop=tuple(stop))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list of messages", "messages")
        call.messages = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
            call.messages.append({**m, "content": _text(m.get("content"), f"messages[{i}].content")})
        tools = body.get("tools")
        call.tools = tools if isinstance(tools, list) and tools else None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad(
                "'prompt' must be a non-empty string (one prompt per call; token ids are not accepted)", "prompt"
            )
        call.prompt = prompt
    return call


def reply_body(call: Call, r: Reply) -> dict:
    usage = {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }
    head = {"created": int(time.time()), "model": call.model, "usage": usage}
    if call.chat:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            **head,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text},
                    "finish_reason": r.finish_reason,
                    "logprobs": None,
                }
            ],
        }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        **head,
        "choices": [{"index": 0, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}],
    }


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


Handler = Callable[[str, Call], Awaitable[Reply]]
# (bearer token, the conversation the path names or None) -> the conversation the request is for
# (None: it names none, e.g. /v1/models); raises ProxyError (401) for a token that may not
Authorize = Callable[[str, str | None], str | None]
# where the bearer-token middleware leaves the request's conversation for the handlers
CONVERSATION = web.RequestKey("conversation", str | None)


def make_app(handle: Handler, authorize: Authorize) -> web.Application:
    async def answer(request: web.Request, chat: bool) -> web.Response:
        conv = request[CONVERSATION] or ""
        try:
            try:
                body = json.loads(await request.read())
            except ValueError:
                raise _bad("the request body is not valid JSON") from None
            call = parse_call(body, chat)
            return web.json_response(reply_body(call, await handle(conv, call)))
        except ProxyError as e:
            return _error(e.status, e.message, e.kind, e.param, e.code)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds {MAX_BODY_BYTES} bytes", "invalid_request_error")
        except Exception as e:  # a bug here: the agent gets a 500 with the reason, the endpoint stays up
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, f"internal error: {e!r}", "server_error")

    async def chat(request):
        return await answer(request, True)

    async def completion(request):
        return await answer(request, False)

    async def models(_request):
        return web.json_response(
            {"object": "list", "data": [{"id": "policy", "object": "model", "created": 0, "owned_by": "areal-flow"}]}
        )

    @web.middleware
    async def unknown_as_json(request, handler):  # a wrong path or method: an OpenAI-style error too
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, f"{request.method} {request.path}: {e.reason}", "invalid_request_error")

    @web.middleware
    async def bearer_token(request, handler):  # outermost: nothing is answered without a valid token
        header = request.headers.get("Authorization", "")
        token = header[len("Bearer ") :].strip() if header.startswith("Bearer ") else ""
        try:
            request[CONVERSATION] = authorize(token, request.match_info.get("conv"))
        except ProxyError as e:
            return _error(e.status, e.message, e.kind, e.param, e.code)
        return await handler(request)

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[bearer_token, unknown_as_json])
    for prefix in ("/c/{conv}/v1", "/v1"):
        app.router.add_post(prefix + "/chat/completions", chat)
        app.router.add_post(prefix + "/completions", completion)
        app.router.add_get(prefix + "/models", models)
    return app


async def serve(handle: Handler, authorize: Authorize, started: asyncio.Future, host: str = "127.0.0.1") -> None:
    """Serve on ``host`` at a free port (``started`` gets it) until cancelled."""
    runner = web.AppRunner(make_app(handle, authorize), access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
    except BaseException as e:
        await runner.cleanup()
        if not started.done():
            started.set_exception(e)
        raise
    started.set_result(port)
    log.info("OpenAI-compatible endpoint on http://%s:%d/v1", host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
