"""The ``openai_agent`` episode: an agent written against the official ``openai`` client, trained
as it is.

For each trajectory of a group the episode calls the agent function (``episode.path``)::

    def agent(client: dict, prompt: str, **options) -> str      # or ``async def``

``client`` is ``{"base_url": "http://127.0.0.1:PORT/c/<conversation>/v1", "api_key": "<its key>"}``
(``openai.OpenAI(**client)``; the key is a secret of that conversation's, and the endpoint answers
nothing without it or the run's own secret), ``prompt`` the dataset prompt as text, ``options`` the episode's
``options``; it returns the final answer, which the task's grader grades. A sync agent runs in a
thread of its own, an async one on the rollout loop (it must not block).

Every model call the agent makes goes to a local OpenAI-compatible endpoint (``openai_proxy``)
and becomes one policy turn of that conversation's trajectory (``ctx.generate``), so the
trajectory is one token sequence: the first call's prompt (it replaces the dataset prompt: a
system prompt or few-shot examples of the agent's are part of it), then the policy's answer,
then whatever the agent added before its next call (tool output, its own text, the chat
template's turn markers: ``append_environment``, mask 0, never trained), the next answer, ...

A later call must continue the conversation: its prompt text (a completion's ``prompt``, or the
chat messages rendered) must begin with everything before it, every earlier prompt and answer
as the endpoint returned them. One that does not (the agent dropped or rewrote history) is
refused with a 400 error naming where they differ; the trajectory is one sequence and a group
has a fixed number of them, so there is no second segment to start. The same request again
(a client's retry) gets the same answer again. A ``stop`` string ends the answer before it:
the tokens from the one holding the stop string on are dropped, so the text the agent gets is
exactly what was recorded.

A trajectory may hold only so many tokens (``EpisodeContext.room``: the model's context, the
trainer's micro-batch, the KV budget). Each call's ``max_tokens`` is bounded by what is left; a
call whose prompt leaves no room for one more token is refused (400, code
``context_length_exceeded``, as OpenAI does) and ends the conversation: its answer is graded wrong
(whatever the agent does then, unless it raises under ``on_agent_error: raise``), and the run goes
on. So does a request the rollout server refuses (400). An agent's first prompt that does not fit at
all is an error (that trajectory would hold no token to train).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import inspect
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from areal_core.episodes.base import EpisodeContext, append_environment
from areal_core.episodes.openai_proxy import Call, ProxyError, Reply, serve
from areal_core.reward.result import RewardResult
from areal_core.rollout.client import RolloutServerError
from areal_core.types import Trajectory

log = logging.getLogger(__name__)


def load_agent(path: str):
    module, name = path.split(":")
    try:
        agent = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"episode.path {path!r}: {e}") from None
    if not callable(agent):
        raise ValueError(f"episode.path {path!r} is not a function")
    return agent


class ChatRenderer:
    """Chat messages -> prompt text: with ``tokenizer`` (a Hugging Face tokenizer folder or name),
    its chat template (or ``chat_template``); with only ``chat_template`` (Jinja text), that
    template; with neither, the messages' contents one after another (the char model's way)."""

    def __init__(self, chat_template: str | None = None, tokenizer: str | None = None):
        self.template, self.tok, self._jinja = chat_template, None, None
        if tokenizer:
            from areal_core.models.tokenizer import load_tokenizer

            self.tok = load_tokenizer(tokenizer)
            if not (chat_template or self.tok.chat_template):
                raise ValueError(f"episode.tokenizer {tokenizer!r} has no chat template: give episode.chat_template")
        elif chat_template:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = raise_exception
            self._jinja = env.from_string(chat_template)

    def __call__(self, messages: list[dict], tools: list | None = None) -> str:
        if self.tok is not None:
            return self.tok.apply_chat_template(
                messages, tools=tools, chat_template=self.template, add_generation_prompt=True, tokenize=False
            )
        if self._jinja is not None:
            return self._jinja.render(
                messages=messages, tools=tools, add_generation_prompt=True, bos_token="", eos_token=""
            )
        return "".join(m["content"] for m in messages)

    def user_text(self, prompt_ids: list[int]) -> str | None:
        """The user message inside a prompt encoded with this chat template, or None."""
        if self.tok is None:
            return None
        raw, mark = self.tok.decode(prompt_ids, skip_special_tokens=False), "\x00PROMPT\x00"
        parts = self([{"role": "user", "content": mark}]).split(mark)
        if (
            len(parts) == 2
            and raw.startswith(parts[0])
            and raw.endswith(parts[1])
            and len(raw) >= len(parts[0]) + len(parts[1])
        ):
            return raw[len(parts[0]) : len(raw) - len(parts[1])]
        return None


TOO_LONG = "context_length_exceeded"  # OpenAI's error code for a prompt the context cannot take


@dataclass
class Conversation:
    id: str
    traj: Trajectory
    ctx: EpisodeContext
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # its API key (a bearer token)
    text: str = ""  # what the trajectory's tokens stand for, in the requests' text
    calls: int = 0
    last: tuple[str, Reply] | None = None  # the latest call's prompt text and reply (a retry gets it again)
    error: BaseException | None = None  # generation failed: the run's problem, not the agent's
    ended: str | None = None  # why it can go no further (no room left): graded wrong
    open: bool = True
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # the group's task's context: generation runs in it (the controller routes by context variables)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


def cut_at_stop(ids: list[int], stops, decode) -> int | None:
    """How many of ``ids`` come before the first stop string (None: no stop string in their text)."""
    text = decode(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return None
    at, k = min(hits), 0
    while k < len(ids) and len(decode(ids[: k + 1])) <= at:
        k += 1
    return k


def _truncate(traj: Trajectory, n: int) -> None:
    del traj.output_ids[n:], traj.output_logprobs[n:], traj.output_versions[n:]
    if traj.output_mask:
        del traj.output_mask[n:]


def _diverged(conv: Conversation, text: str) -> str:
    i = len(os.path.commonprefix([conv.text, text]))  # noqa: RUF071 - texts, not paths
    return (
        f"this request does not continue conversation {conv.id}: its prompt must begin with the "
        f"conversation so far (every earlier prompt and answer as returned), but they differ at character "
        f"{i}: so far ...{conv.text[max(0, i - 40) : i + 40]!r}, this request ...{text[max(0, i - 40) : i + 40]!r}"
    )


class OpenAIAgent:
    """The episode (see the module docstring); one local endpoint per event loop, shared by all groups."""

    def __init__(
        self,
        path,
        options: dict[str, Any] | None = None,
        max_calls: int = 8,
        max_new_tokens_per_call: int | None = None,
        chat_template: str | None = None,
        tokenizer: str | None = None,
        timeout_s: float = 600.0,
        on_agent_error: str = "raise",
        max_concurrent: int = 64,
    ):
        agent = load_agent(path) if isinstance(path, str) else path  # "module:function", or the function
        if on_agent_error not in ("raise", "wrong"):
            raise ValueError(f"on_agent_error must be 'raise' or 'wrong', got {on_agent_error!r}")
        self.agent, self.options = agent, dict(options or {})
        call = getattr(agent, "__call__", None)  # noqa: B004 - an agent object's own __call__: is it async?
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(call)
        self.max_calls, self.max_new, self.timeout_s = max_calls, max_new_tokens_per_call, timeout_s
        self.on_agent_error, self.max_concurrent = on_agent_error, max_concurrent
        self.render = ChatRenderer(chat_template, tokenizer)
        self.secret = secrets.token_urlsafe(32)  # the run's key to the endpoint (each conversation has its own)
        self._convs: dict[str, Conversation] = {}
        self._by_key: dict[str, str] = {}  # conversation key -> conversation id
        self._server = None  # (loop, serving task, future of its port)
        self._threads: ThreadPoolExecutor | None = None

    async def port(self) -> int:
        """The local endpoint's port, started on this loop at the first call."""
        loop = asyncio.get_running_loop()
        s = self._server
        if s is None or s[0] is not loop or s[1].done():
            started = loop.create_future()
            s = self._server = (
                loop,
                loop.create_task(serve(self.handle, self.authorize, started), name="openai-endpoint"),
                started,
            )
        return await asyncio.shield(s[2])

    async def run(self, group: list[Trajectory], ctx: EpisodeContext) -> list[RewardResult]:
        port = await self.port()
        convs = [Conversation(secrets.token_urlsafe(12), t, ctx) for t in group]
        self._convs.update((c.id, c) for c in convs)
        self._by_key.update((c.key, c.id) for c in convs)
        try:
            outcomes = await asyncio.gather(*(self._drive(c, port) for c in convs))
        finally:
            for c in convs:
                c.open = False
                self._convs.pop(c.id, None)
                self._by_key.pop(c.key, None)
        results = [RewardResult(correct=False, reason=(err or "")[:500]) for _, err in outcomes]
        done = [i for i, (answer, _) in enumerate(outcomes) if answer is not None]
        if done:
            graded = await ctx.grade([group[i] for i in done], [outcomes[i][0] for i in done])
            for i, r in zip(done, graded):
                results[i] = r
        for c in convs:
            c.traj.reward_info = {**c.traj.reward_info, "turns": c.calls}
        return results

    def authorize(self, token: str, conv_id: str | None) -> str | None:
        """The endpoint's check of a request's bearer token (see openai_proxy.Authorize): the run's
        secret (for the conversation the path names, if any), or a conversation's own key (for that
        conversation only)."""
        if token and secrets.compare_digest(token, self.secret):
            return conv_id
        owner = self._by_key.get(token) if token else None
        if owner is not None and conv_id in (None, owner):
            return owner
        why = (
            "no API key" if not token else "a wrong API key" if owner is None else "the API key of another conversation"
        )
        raise ProxyError(
            401,
            f"this endpoint needs the API key the agent was given (Authorization: Bearer ...); the request had {why}",
            "invalid_request_error",
            code="invalid_api_key",
        )

    async def _drive(self, conv: Conversation, port: int) -> tuple[str | None, str | None]:
        """Run the agent on one conversation: (its answer, None) or (None, why it is graded wrong):
        the conversation ran out of room, or (under on_agent_error 'wrong') the agent failed."""
        client = {"base_url": f"http://127.0.0.1:{port}/c/{conv.id}/v1", "api_key": conv.key}
        prompt = self.render.user_text(conv.traj.prompt_ids)
        prompt = prompt if prompt is not None else conv.ctx.decode(conv.traj.prompt_ids)
        try:
            if self.is_async:
                work = self.agent(client, prompt, **self.options)
            else:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="openai-agent")
                work = asyncio.get_running_loop().run_in_executor(
                    self._threads, functools.partial(self.agent, client, prompt, **self.options)
                )
            answer = await asyncio.wait_for(work, self.timeout_s)
            if not isinstance(answer, str):
                raise TypeError(f"the agent returned {type(answer).__name__}, not the answer's text")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if conv.error is not None:
                raise conv.error from e
            if isinstance(e, TimeoutError):
                e = TimeoutError(f"no answer within timeout_s={self.timeout_s}")
            if self.on_agent_error == "raise" or not self._trainable(conv):
                why = f" ({conv.ended})" if conv.ended else ""
                raise RuntimeError(
                    f"the agent failed on {conv.traj.traj_id} after {conv.calls} model calls: {e!r}{why}"
                ) from e
            log.warning("agent failed on %s after %d calls (graded wrong): %r", conv.traj.traj_id, conv.calls, e)
            return None, conv.ended or f"agent failed: {e!r}"
        if conv.error is not None:
            raise conv.error
        if not self._trainable(conv):
            why = f" ({conv.ended})" if conv.ended else ""
            raise RuntimeError(
                f"the agent answered {conv.traj.traj_id} without a model call that produced "
                f"a token ({conv.calls} calls): nothing to train{why}"
            )
        if conv.ended:
            return None, conv.ended
        return answer, None

    @staticmethod
    def _trainable(conv: Conversation) -> bool:
        t = conv.traj
        return bool(sum(t.output_mask) if t.output_mask else t.output_ids)

    async def handle(self, conv_id: str, call: Call) -> Reply:
        """One model call of a conversation (the endpoint's handler)."""
        conv = self._convs.get(conv_id)
        if conv is None or not conv.open:
            raise ProxyError(
                404,
                f"no open conversation {conv_id!r}: use the base_url (or api_key) the agent "
                "was given, while its episode runs",
                "not_found_error",
            )
        async with conv.lock:  # one call at a time: each extends the one before
            if not conv.open:
                raise ProxyError(404, f"conversation {conv_id!r} is over", "not_found_error")
            if call.chat:
                try:
                    text = self.render(call.messages, call.tools)
                except Exception as e:  # the template refuses these messages (roles, ...)
                    raise ProxyError(
                        400, f"the chat template cannot render these messages: {e}", param="messages"
                    ) from e
            else:
                text = call.prompt
            return await self._record(conv, text, call)

    async def _record(self, conv: Conversation, text: str, call: Call) -> Reply:
        traj, ctx = conv.traj, conv.ctx
        if conv.last is not None and conv.last[0] == text:
            return conv.last[1]
        if conv.ended:
            raise ProxyError(400, f"conversation {conv.id} has ended: {conv.ended}", code=TOO_LONG)
        if conv.calls >= self.max_calls:
            raise ProxyError(400, f"conversation {conv.id} has made max_calls={self.max_calls} model calls")
        param = "messages" if call.chat else "prompt"
        if conv.calls == 0:  # the agent's first prompt is the trajectory's prompt
            ids = ctx.encode(text)
            if not ids:
                raise ProxyError(400, "the prompt encodes to no tokens", param="prompt")
            traj.prompt_ids = ids
            self._room_for(conv, [], param)
        else:
            if not text.startswith(conv.text):
                raise ProxyError(400, _diverged(conv, text), param=param)
            ids = ctx.encode(text[len(conv.text) :])
            if ids and traj.output_ids and ids[0] == traj.output_ids[-1] and ctx.decode(ids[:1]) == "":
                ids = ids[1:]  # the template's end-of-turn token, which the policy sampled already
            self._room_for(conv, ids, param)
            append_environment(traj, ids, ctx.version)
        conv.text = text
        start = len(traj.output_ids)
        room = ctx.room(traj)  # (>= 1: checked above)
        limits = [n for n in (call.max_tokens, self.max_new, room) if n]
        stop_ids = sorted({ids[0] for ids in map(ctx.encode, call.stop) if len(ids) == 1})
        turn = ctx.generate([traj], min(limits) if limits else None, *([stop_ids] if stop_ids else []))
        try:  # (a stop string of one token ends generation there; any other is cut out afterwards)
            await asyncio.get_running_loop().create_task(turn, context=conv.context)
        except RolloutServerError as e:
            if e.status != 400:
                conv.error = e
                raise ProxyError(500, f"generation failed: {e!r}", "server_error") from None
            conv.ended = f"the rollout server refused the request: {e.message}"  # the request, not the run
            log.warning("conversation of %s ends: %s", traj.traj_id, conv.ended)
            raise ProxyError(400, conv.ended, param=param, code=TOO_LONG) from None
        except Exception as e:  # noqa: BLE001 - the agent's 500; the error is kept for the run
            conv.error = e
            raise ProxyError(500, f"generation failed: {e!r}", "server_error") from None
        finish = "length" if traj.finish_reason == "length" else "stop"
        keep = cut_at_stop(traj.output_ids[start:], call.stop, ctx.decode) if call.stop else None
        if keep is not None:
            _truncate(traj, start + keep)
            finish = traj.finish_reason = "stop"
        answer = ctx.decode(traj.output_ids[start:])
        conv.text += answer
        conv.calls += 1
        reply = Reply(answer, finish, len(traj.prompt_ids) + start, len(traj.output_ids) - start)
        conv.last = (text, reply)
        return reply

    @staticmethod
    def _room_for(conv: Conversation, ids: list[int], param: str) -> None:
        """Refuse (400 ``context_length_exceeded``) a call whose prompt, with ``ids`` of new environment
        text, leaves no room for one more token, and end the conversation."""
        traj, room = conv.traj, conv.ctx.room(conv.traj)
        if room is None or len(ids) < room:
            return
        have = len(traj.prompt_ids) + len(traj.output_ids) + len(ids)
        conv.ended = (
            f"the conversation no longer fits: its prompt of {have} tokens leaves no room in the "
            f"{have - len(ids) + room} tokens a trajectory may hold (the model's context, "
            "trainer.max_tokens_per_microbatch, rollout.kv_budget)"
        )
        log.warning("conversation of %s ends: %s", traj.traj_id, conv.ended)
        raise ProxyError(400, conv.ended, param=param, code=TOO_LONG)
