"""Tool use: the policy may call Python, in the sandbox, and read its output before it answers.

A turn ends where the policy closes a call (``<py>3+5+7</py>``): the code between the tags runs in
the sandbox that grades code (:mod:`areal_core.reward.sandbox`; never in this process), and its
output comes back as the next message, ``<out>15</out>``: environment text, ``output_mask`` 0 (context
for the policy, never trained). The policy then goes on: another call, or its answer. At most
``max_calls`` calls run per answer (a turn after the last one is generated without the stop, so a
call written then is plain text); each runs for at most ``timeout_s`` seconds and its output is cut
to ``max_output_chars``. The whole answer (the policy's turns and the outputs between them) is
graded once, as a single-turn answer is: for the chain task's ``format: tool`` the reference is the
transcript itself, so an answer is right when its call is the right one and it copies the output.

A call runs like a REPL line: its output is what it prints, then the ``repr`` of the value of a final
expression (``3+5+7`` gives ``15``); an exception gives its last traceback line
(``ZeroDivisionError: division by zero``). No call can reach another: the calls of one step of a
group share one sandbox run where the sandbox has user ids of its own (``sandbox.run_each``: each
call in a process and under a user id of its own, with a private ``/tmp``, forked from a zygote
that never holds another call's code or output, its output on a pipe of its own, everything of its
user id killed before the next call starts); elsewhere each call has a sandbox run of its own. A
batched run that fails as a whole is done again one call per run; whether a call's process entered
the sandbox is said by trusted code on a channel of its own, so a call cannot feign a failure (and
get the others run again) or hide one.

Evaluation: the run's own held-out accuracy (before and after RL) is single-turn, with no tools; the
accuracy *with* tools, greedy, on the same held-out problems and checkpoints, is
``python -m areal_core.eval.with_tools heldout RUN_DIR`` (:func:`areal_core.eval.with_tools.evaluate_heldout`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from areal_core.data.synthetic import TOOL_CLOSE, TOOL_OPEN, TOOL_RESULT
from areal_core.episodes.base import EpisodeContext, append_environment, fits
from areal_core.reward.code import RUNNER_SOURCE
from areal_core.reward.result import RewardResult
from areal_core.reward.sandbox import SandboxLimits, SandboxRun, guarantees, run_each, run_python_file
from areal_core.types import Trajectory

log = logging.getLogger(__name__)

MAX_REOPEN = 8  # a turn stopped by a stop token that closes no call goes on, at most this often


@dataclass(frozen=True)
class CallResult:
    output: str  # what the call printed (and its final value), cut to max_output_chars
    timed_out: bool = False
    truncated: bool = False
    failed: bool = False  # the sandbox could not run it (the output says why)


class PythonTool:
    """Runs Python calls in the sandbox (:mod:`areal_core.reward.sandbox`), no call able to reach another (see
    the module docstring). ``run`` blocks; it is thread-safe."""

    def __init__(
        self, timeout_s: float = 2.0, max_output_chars: int = 64, memory_mb: int = 512, mode: str | None = None
    ):
        if timeout_s <= 0 or max_output_chars < 1:
            raise ValueError("timeout_s must be > 0 and max_output_chars >= 1")
        self.timeout_s, self.max_output_chars, self.memory_mb, self.mode = timeout_s, max_output_chars, memory_mb, mode
        self.n_sandbox_runs = 0
        self._lock = threading.Lock()

    def limits(self) -> SandboxLimits:
        """Each call's limits: its time, a CPU second more, its memory, 1 MiB of output."""
        return SandboxLimits(
            wall_s=self.timeout_s,
            cpu_s=int(self.timeout_s) + 1,
            memory_mb=self.memory_mb,
            max_processes=32,
            file_size_mb=1,
        )

    def _count(self) -> None:
        with self._lock:
            self.n_sandbox_runs += 1

    def _together(self, codes: list[str]) -> list[CallResult] | None:
        """One sandbox run for ``codes``, each call in a process and under a user id of its own
        (``sandbox.run_each``); None when the run failed as a whole (which no call can cause or feign)."""
        self._count()
        runs = run_each(
            RUNNER_SOURCE, "repl_prepare", "batch_repl", [c.encode() for c in codes], self.limits(), self.mode
        )
        if runs is None:
            log.warning("a sandbox run of %d tool calls failed as a whole; running them one by one", len(codes))
            return None
        return [self._result(r) for r in runs]

    def _alone(self, code: str) -> CallResult:
        """A sandbox run of its own for ``code``."""
        self._count()
        run = run_python_file("runner.py", {"runner.py": RUNNER_SOURCE}, code, self.limits(), self.mode, ("repl",))
        if run.setup_error is not None:
            log.warning("a tool call did not run: %s", run.reason())
            return CallResult("Error: the call did not run in the sandbox", failed=True)
        return self._result(run)

    def _result(self, run: SandboxRun) -> CallResult:
        output = run.stdout.rstrip()
        truncated = len(output) > self.max_output_chars
        if truncated:
            output = output[: self.max_output_chars] + "..."
        if run.timed_out:
            output = (output + "\n" if output else "") + f"TimeoutError: the call ran past {self.timeout_s:g}s"
        elif run.limit is not None:
            output = (output + "\n" if output else "") + f"Error: {run.reason()}"
        return CallResult(output, timed_out=run.timed_out, truncated=truncated)

    def run(self, codes: Sequence[str]) -> list[CallResult]:
        """Each call's result, in order."""
        codes = list(codes)
        if len(codes) > 1 and guarantees(self.mode)["own_user"]:
            results = self._together(codes)
            if results is not None:
                return results
        return [self._alone(code) for code in codes]


_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


def _executor(n: int) -> ThreadPoolExecutor:
    """Sandbox runs wait in a pool of their own (``max_parallel`` at a time), off the event loop."""
    if n not in _EXECUTORS:
        _EXECUTORS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tool-sandbox")
    return _EXECUTORS[n]


class ToolUse:
    """The tool-use episode (see the module docstring); ``tool``: a :class:`PythonTool`-like object
    with ``run(codes) -> list[CallResult]`` (tests pass their own)."""

    def __init__(
        self,
        max_calls: int = 1,
        timeout_s: float = 2.0,
        max_output_chars: int = 64,
        max_new_tokens_per_turn: int | None = None,
        open_tag: str = TOOL_OPEN,
        close_tag: str = TOOL_CLOSE,
        result_template: str = TOOL_RESULT,
        stop_token_ids: Sequence[int] | None = None,
        memory_mb: int = 512,
        max_parallel: int = 2,
        tool=None,
    ):
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must not be empty")
        if "{output}" not in result_template:
            raise ValueError(f"result_template must hold {{output}}, got {result_template!r}")
        self.max_calls, self.max_new = max_calls, max_new_tokens_per_turn
        self.open_tag, self.close_tag, self.result_template = open_tag, close_tag, result_template
        self.stop_token_ids = None if stop_token_ids is None else tuple(stop_token_ids)
        self.max_parallel = max_parallel
        self.tool = tool if tool is not None else PythonTool(timeout_s, max_output_chars, memory_mb)

    def stops(self, ctx: EpisodeContext) -> tuple[int, ...]:
        """The tokens a turn stops at: the last token of the closing tag, unless given."""
        if self.stop_token_ids is not None:
            return self.stop_token_ids
        ids = ctx.encode(self.close_tag)
        return (ids[-1],) if ids else ()

    def call_of(self, turn: str) -> str | None:
        """The code of the call a turn ends with (``<py>code</py>``), or None."""
        if not turn.endswith(self.close_tag):
            return None
        body = turn[: len(turn) - len(self.close_tag)]
        start = body.rfind(self.open_tag)
        return None if start < 0 else body[start + len(self.open_tag) :]

    async def _turn(self, trajs: list[Trajectory], ctx: EpisodeContext, stops: tuple[int, ...]) -> list[int]:
        """One policy turn of each of ``trajs`` (ending at EOS, its budget, or a closed call); returns
        where each turn began."""
        starts = [len(t.output_ids) for t in trajs]
        if not trajs:
            return starts
        await ctx.generate(trajs, self.max_new, stops)
        if stops:
            await asyncio.gather(*(self._go_on(t, s, ctx, stops) for t, s in zip(trajs, starts)))
        return starts

    async def _go_on(self, t: Trajectory, start: int, ctx: EpisodeContext, stops: tuple[int, ...]) -> None:
        """A turn that stopped at a stop token without closing a call (the ``>`` of ``<py>``) goes on."""
        for _ in range(MAX_REOPEN):
            if not (t.finish_reason == "stop" and t.output_ids and t.output_ids[-1] in stops) or ctx.decode(
                t.output_ids[start:]
            ).endswith(self.close_tag):
                return
            left = None if self.max_new is None else self.max_new - (len(t.output_ids) - start)
            if left is not None and left <= 0:
                t.finish_reason = "length"
                return
            if not t.output_mask:  # so that the controller counts this turn's budget from here
                t.output_mask = [1] * len(t.output_ids)
            t.finish_reason = ""
            await ctx.generate([t], left, stops)

    async def run(self, group: list[Trajectory], ctx: EpisodeContext) -> list[RewardResult]:
        stops = self.stops(ctx) if self.max_calls > 0 else ()
        calls = [0] * len(group)
        active = list(range(len(group)))
        starts = await self._turn(group, ctx, stops)
        turn_start = dict(zip(active, starts))
        loop = asyncio.get_running_loop()
        while True:
            pending, codes = [], []
            for i in active:
                t = group[i]
                if (
                    calls[i] < self.max_calls
                    and t.finish_reason == "stop"
                    and t.output_ids
                    and t.output_ids[-1] in stops
                ):
                    code = self.call_of(ctx.decode(t.output_ids[turn_start[i] :]))
                    if code is not None:
                        pending.append(i)
                        codes.append(code)
            if not pending:
                break
            results = await loop.run_in_executor(_executor(self.max_parallel), self.tool.run, codes)
            ended = set()
            for i, r in zip(pending, results):
                output = ctx.encode(self.result_template.format(output=r.output))
                if not fits(ctx, group[i], output):  # no room for the output and an answer: it ends here
                    group[i].finish_reason = "length"
                    ended.add(i)
                    continue
                append_environment(group[i], output, ctx.version)
                calls[i] += 1
                info = group[i].reward_info
                info["tool_timeouts"] = info.get("tool_timeouts", 0) + int(r.timed_out)
                info["tool_failures"] = info.get("tool_failures", 0) + int(r.failed)
            pending = [i for i in pending if i not in ended]
            more = [i for i in pending if calls[i] < self.max_calls]
            last = [i for i in pending if calls[i] >= self.max_calls]  # no stop: a call now is plain text
            s1, s2 = await asyncio.gather(
                self._turn([group[i] for i in more], ctx, stops), self._turn([group[i] for i in last], ctx, ())
            )
            turn_start = {**dict(zip(more, s1)), **dict(zip(last, s2))}
            active = more + last
        for t, n in zip(group, calls):
            t.reward_info = {**t.reward_info, "turns": n + 1, "tool_calls": n}
        return await ctx.grade(group, [ctx.decode(t.output_ids) for t in group])
