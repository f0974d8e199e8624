"""One rollout server: continuous batching over a KV cache of bounded size.

The server never simulates single decode steps one by one. Between two events
(a request finishing, the KV cache filling, a request arriving, a weight update)
its batch is fixed, so the time of the next k steps has a closed form
(`CostModel.decode_span_s`). Its clock always sits on a step boundary: something
that arrives mid-step waits for the step to end, as it does in a real engine.

A group's fresh answers admitted together on one server prefill their shared prompt
once (the embedded engine runs identical token lists once; SGLang's radix cache shares
the prefix). The run spreads answers over the servers one by one, least loaded first.

Per running request the server keeps the step at which it joined and how many
tokens it had then, so the total context is `base + batch * steps` and a finish
or a full KV cache is found without touching every request.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from areal_core.rollout.backend import WeightUpdateMode
from areal_core.sim.cost import CostModel


@dataclass
class Request:
    """One answer to generate."""

    rid: int
    group: int
    prompt: int
    target: int  # output tokens it will have when done
    admit_version: int
    server: int = -1
    generated: int = 0  # output tokens so far (while running: as of joining)
    first_version: int = -1  # weight version of its first token
    join_step: int = 0
    join_seq: int = -1
    done_time: float = float("nan")

    @property
    def context(self) -> int:
        return self.prompt + self.generated


class RolloutServer:
    """Continuous batching with a weight-update mode: reprefill, keep_kv or drain."""

    def __init__(
        self, index: int, cost: CostModel, tp: int, update_mode: WeightUpdateMode, max_running: int, admit_reserve: int
    ):
        self.index = index
        self.cost = cost
        self.tp = tp
        self.update_mode = update_mode
        self.max_running = max_running
        self.admit_reserve = admit_reserve
        self.capacity = cost.kv_capacity_tokens
        self.clock = 0.0
        self.steps = 0
        self.base = 0  # context tokens = base + len(running) * steps
        self.running: dict[int, Request] = {}  # insertion order = join order
        self.finish_heap: list[tuple[int, int, int]] = []  # (finish step, join seq, rid)
        self.queue: deque[Request] = deque()
        self.version = 0
        self.pending_version: int | None = None  # a drain in progress
        self.busy: list[list[float]] = []  # merged [start, end] intervals of decode/prefill
        self.generated_tokens = 0
        self.retracted = 0
        self.event_token = 0
        self._join_seq = 0

    # ---- state ----------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.running)

    @property
    def context_tokens(self) -> int:
        return self.base + self.batch * self.steps

    def in_flight(self) -> int:
        return self.batch + len(self.queue)

    def _steps_to_next_internal(self) -> int | None:
        """Decode steps until the next finish or until the next step would overflow KV."""
        b = self.batch
        if b == 0:
            return None
        heap = self.finish_heap
        while heap and (heap[0][2] not in self.running or self.running[heap[0][2]].join_seq != heap[0][1]):
            heapq.heappop(heap)  # a retracted request's old entry
        to_finish = heap[0][0] - self.steps
        if b == 1:
            return to_finish  # one sequence always fits (checked against the capacity)
        # the step from S to S+1 writes b tokens: it fits while context + b <= capacity
        to_overflow = (self.capacity - b - self.base) // b - self.steps + 1
        return max(min(to_finish, to_overflow), 0)

    def next_event_time(self) -> float | None:
        k = self._steps_to_next_internal()
        if k is None:
            return None
        return self.clock + self.cost.decode_span_s(self.batch, self.context_tokens, k)

    # ---- time -----------------------------------------------------------------------
    def _mark_busy(self, start: float, end: float) -> None:
        if end <= start:
            return
        if self.busy and start <= self.busy[-1][1] + 1e-9:
            self.busy[-1][1] = max(self.busy[-1][1], end)
        else:
            self.busy.append([start, end])

    def advance(self, t: float) -> None:
        """Move to the first step boundary at or after `t` (never past the next internal
        event, which the caller processes at its own time)."""
        if t <= self.clock:
            return
        k_max = self._steps_to_next_internal()
        if k_max is None:
            self.clock = t
            return
        b, ctx = self.batch, self.context_tokens
        k = self.cost.steps_to_reach(b, ctx, t - self.clock, k_max)
        span = self.cost.decode_span_s(b, ctx, k)
        self._mark_busy(self.clock, self.clock + span)
        self.clock += span
        self.steps += k
        self.generated_tokens += b * k

    # ---- requests -------------------------------------------------------------------
    def _remove(self, req: Request) -> None:
        del self.running[req.rid]
        self.base -= req.prompt + req.generated - req.join_step  # `generated` is still its join value
        req.generated += self.steps - req.join_step

    def _join(self, req: Request) -> None:
        req.join_step = self.steps
        req.join_seq = self._join_seq
        self._join_seq += 1
        if req.first_version < 0:
            req.first_version = self.version
        self.running[req.rid] = req
        self.base += req.prompt + req.generated - self.steps
        heapq.heappush(self.finish_heap, (self.steps + req.target - req.generated, req.join_seq, req.rid))

    def _retire_finished(self) -> list[Request]:
        done = []
        heap = self.finish_heap
        while heap and heap[0][0] <= self.steps:
            _, seq, rid = heapq.heappop(heap)
            req = self.running.get(rid)
            if req is None or req.join_seq != seq:
                continue  # retracted since
            self._remove(req)
            req.done_time = self.clock
            done.append(req)
        return done

    def _relieve_kv(self) -> None:
        """Retract the newest requests (back to the queue front, progress kept) until the
        next step fits, as SGLang does when its KV pool runs out."""
        while self.batch > 1 and self.context_tokens + self.batch > self.capacity:
            rid = next(reversed(self.running))
            req = self.running[rid]
            self._remove(req)
            self.queue.appendleft(req)
            self.retracted += 1

    def _admit(self) -> None:
        if self.pending_version is not None:
            return  # draining: admit nothing until the new weights are in
        tokens = sq = 0
        fresh_groups: set[int] = set()  # a group's fresh answers share one prompt: prefilled once
        while self.queue and self.batch < self.max_running:
            req = self.queue[0]
            need = req.context
            reserve = (self.batch + 1) * self.admit_reserve
            if self.batch > 0 and self.context_tokens + need + reserve > self.capacity:
                break
            self.queue.popleft()
            self._join(req)
            if req.generated == 0:
                if req.group in fresh_groups:
                    continue
                fresh_groups.add(req.group)
            tokens += need
            sq += need * need
        if tokens:
            dt = self.cost.prefill_s(tokens, sq)
            self._mark_busy(self.clock, self.clock + dt)
            self.clock += dt

    def _load_weights(self, version: int) -> float:
        """Pause -> load -> resume; returns when the new version is live."""
        self.clock += self.cost.weight_update_s
        self.version = version
        return self.clock

    def settle(self) -> tuple[list[Request], float | None]:
        """After reaching a boundary: retire finished answers, make room in KV, finish a
        drain, admit queued requests. Returns (finished, time a drained update went live)."""
        done = self._retire_finished()
        self._relieve_kv()
        confirmed = None
        if self.pending_version is not None and self.batch == 0:
            version, self.pending_version = self.pending_version, None
            confirmed = self._load_weights(version)
        self._admit()
        return done, confirmed

    def touch(self, t: float) -> tuple[list[Request], float | None]:
        self.advance(t)
        return self.settle()

    def submit(self, req: Request) -> None:
        self.queue.append(req)

    def begin_update(self, version: int, t: float) -> tuple[list[Request], float | None]:
        """A new version arrives at `t`. Returns (finished while reaching the boundary,
        time the version went live or None if it waits for a drain)."""
        self.advance(t)
        done = self._retire_finished()
        self._relieve_kv()
        if self.update_mode == "drain":
            self.pending_version = version
            _, confirmed = self.settle()
            return done, confirmed
        confirmed = self._load_weights(version)
        if self.update_mode == "reprefill" and self.running:
            # the KV was computed by the old weights: recompute prompt + output so far
            tokens = sq = 0
            for req in self.running.values():
                ctx = req.prompt + req.generated + (self.steps - req.join_step)
                tokens += ctx
                sq += ctx * ctx
            dt = self.cost.prefill_s(tokens, sq)
            self._mark_busy(self.clock, self.clock + dt)
            self.clock += dt
        more, _ = self.settle()
        return done + more, confirmed
