"""Rollout controller: paces generation with the staleness gate and dispatches rewards.

It runs an asyncio loop in a background thread. For each prompt it admits a
group of n generation requests only while the staleness gate holds, sends
them to the rollout servers through the rollout client, and submits every
finished trajectory's grading to the Dask reward service at once, without
waiting for it. Rewarded trajectories land in the replay buffer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from areal_core.algo import staleness_allows
from areal_core.buffer import ReplayBuffer
from areal_core.reward.result import RewardResult
from areal_core.reward.service import RewardService
from areal_core.rollout.client import RolloutPool
from areal_core.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """A dataset record ready for generation."""

    id: str
    task: str
    input_ids: list[int]
    reference: str


@dataclass
class ControllerSettings:
    batch_size: int
    eta: int
    n_samples: int
    sampling: dict
    reward_correct: float
    reward_wrong: float
    shuffle: bool = True
    seed: int = 0


def prompt_stream(prompts: list[Prompt], shuffle: bool, seed: int, start_epoch: int = 0) -> Iterator[tuple[int, Prompt]]:
    """Endless (epoch, prompt) stream; each epoch is a fresh permutation when shuffling."""
    epoch = start_epoch
    while True:
        order = list(range(len(prompts)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in order:
            yield epoch, prompts[i]
        epoch += 1


class RolloutController:
    def __init__(
        self,
        urls: list[str],
        prompts: list[Prompt],
        decode,  # token ids -> response text
        rewards: RewardService,
        buffer: ReplayBuffer,
        settings: ControllerSettings,
        version: int = 0,
        request_timeout_s: float = 600.0,
    ):
        if not prompts:
            raise ValueError("the controller needs at least one prompt")
        self.urls = urls
        self.decode = decode
        self.rewards = rewards
        self.buffer = buffer
        self.s = settings
        self.version = version
        self.request_timeout_s = request_timeout_s
        self._stream = prompt_stream(prompts, settings.shuffle, settings.seed)
        self.n_submitted = 0
        self.n_generated = 0
        self.generated_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_requested = False
        self._tasks: set[asyncio.Task] = set()

    # lifecycle (called from the trainer's thread) -------------------------
    def start(self) -> "RolloutController":
        self._thread = threading.Thread(target=self._thread_main, name="rollout-controller", daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self) -> None:
        """Stop admitting, abandon in-flight requests, close connections."""
        if self._loop is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        fut.result(timeout=60)
        self._thread.join(timeout=60)
        self._loop = None

    def update_weights(self, model_path: str, version: int) -> None:
        """Make every server load ``version``; returns once all have it. Then the gate moves."""
        assert self._loop is not None, "controller not started"
        asyncio.run_coroutine_threadsafe(self._update_weights(model_path, version), self._loop).result()

    # the event loop -------------------------------------------------------
    def _thread_main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self.pool = RolloutPool(self.urls, timeout_s=self.request_timeout_s)
        self._gate = asyncio.Condition()
        self._main = self._loop.create_task(self._admit_loop())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _admit_loop(self) -> None:
        n, B, eta = self.s.n_samples, self.s.batch_size, self.s.eta
        try:
            while True:
                async with self._gate:
                    # the last of the group's n requests must pass the gate
                    await self._gate.wait_for(
                        lambda: staleness_allows(self.n_submitted + n - 1, self.version, B, eta)
                    )
                epoch, prompt = next(self._stream)
                group_id = f"e{epoch}-p{prompt.id}"
                first = self.n_submitted
                self.n_submitted += n
                self.buffer.admit(group_id, first, self.version, n)
                for k in range(n):
                    traj = Trajectory(
                        traj_id=f"{group_id}-s{k}",
                        group_id=group_id,
                        seq_no=first + k,
                        admit_version=self.version,
                        prompt_ids=list(prompt.input_ids),
                        reference=prompt.reference,
                    )
                    t = asyncio.create_task(self._generate(traj, prompt.task))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # reported to the trainer, which stops the run
            log.exception("rollout admission failed")
            self.buffer.fail(e)

    async def _generate(self, traj: Trajectory, task: str) -> None:
        try:
            resp = await self.pool.generate(traj.prompt_ids, self.s.sampling, rid=traj.traj_id)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.error("generation of %s failed: %r", traj.traj_id, e)
            self.buffer.fail(e)
            return
        meta = resp.meta_info
        traj.output_ids = list(resp.output_ids)
        traj.output_logprobs = [lp for lp, _, _ in meta.output_token_logprobs]
        traj.output_versions = list(meta.output_token_versions)
        traj.finish_reason = meta.finish_reason.type
        self.n_generated += 1
        self.generated_tokens += len(traj.output_ids)
        text = self.decode(traj.output_ids)
        self.rewards.submit(task, text, traj.reference, on_done=lambda r, e: self._rewarded(traj, r, e))

    def _rewarded(self, traj: Trajectory, result: RewardResult | None, error: BaseException | None) -> None:
        if error is not None:
            self.buffer.fail(error)
            return
        traj.correct = bool(result.correct)
        traj.reward = self.s.reward_correct if result.correct else self.s.reward_wrong
        traj.reward_info = result.as_dict()
        self.buffer.put(traj)

    async def _update_weights(self, model_path: str, version: int) -> None:
        await self.pool.update_weights(model_path, version)
        async with self._gate:
            self.version = version
            self._gate.notify_all()

    async def _shutdown(self) -> None:
        self._main.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(self._main, *self._tasks, return_exceptions=True)
        await self.pool.aclose()
        self._loop.call_soon(self._loop.stop)
