"""The asynchronous training loop, as the algorithm reads (AReaL's trainer side):

    for each step:  take B trajectories (waits only for what the staleness bound eta needs)
                    -> one PPO step -> publish the new version (the servers get it while the
                       trainer takes its next batch) -> log; every checkpoint_every steps a checkpoint

Generation never waits for this loop: the controller keeps the servers busy in the background
(``controller/``). Timing lives in :class:`StepClock`; weights leave the trainer only through
:class:`WeightPublisher`; the metrics row is built by :func:`step_row`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from areal_core.controller import RolloutController
from areal_core.controller.agents import FROZEN, AgentRouter
from areal_core.controller.buffer import BufferClosed, ReplayBuffer
from areal_core.controller.elastic import ServersShort
from areal_core.controller.generation import trajectory_seed
from areal_core.controller.prompt_sampling import describe_mix
from areal_core.models.digest import weights_sha256
from areal_core.run.checkpoints import RunCheckpoints
from areal_core.run.costs import CostLedger
from areal_core.run.metrics import RunLog, ledger_rows
from areal_core.run.schedule import CHECKPOINT_FILE, ScheduleLog
from areal_core.storage import run_state
from areal_core.storage.fsutil import FileData
from areal_core.trainer.base import StepResult, TrainEngine
from areal_core.trainer.core_lending import CoreLending
from areal_core.types import Trajectory

log = logging.getLogger(__name__)
METRICS_FLUSH_S = 5.0  # metrics.parquet / ledger.parquet are rewritten at most this often during a run (and at its end)


class StepClock:
    """Wall time of a step's parts, by name (nested parts count in each): ``with clock.part("x"): ...``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.s: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class WeightPublisher:
    """The one way new weights leave the trainer: stage a version in the transport, then push it to
    every server in the background (``controller.update_weights``; the staleness gate moves once all
    hold it). One push at a time: staging the next version first waits for the previous push,
    whose buffer it reuses."""

    def __init__(self, transport, controller: RolloutController):
        self.transport, self.controller = transport, controller
        self._pushing: Future | None = None

    def stage(self, model: torch.nn.Module, version: int) -> None:
        """Stage ``version`` without pushing it: what a restarted server is sent (LoRA runs, whose
        servers start from the base model, before the first step)."""
        self.transport.stage(model, version)

    def publish(self, model: torch.nn.Module, version: int, clock: StepClock) -> None:
        with clock.part("weight_sync_wait_s"):
            self.finish()
        with clock.part("weight_stage_s"):
            self.transport.stage(model, version)
            self._pushing = self.controller.update_weights(version)

    def finish(self) -> None:
        """Wait for the last push (and raise its error)."""
        if self._pushing is not None:
            self._pushing.result()
            self._pushing = None

    def figures(self) -> dict:
        """Bytes each server receives per version; the previous push's time (NaN before the first)."""
        t = self.transport
        return {
            "weight_update_bytes": t.staged_bytes,
            "weight_push_s": math.nan if t.last_push_s is None else t.last_push_s,
        }


@dataclass
class Loop:
    """What the training loop works with; built by ``run.py``."""

    name: str
    model: torch.nn.Module
    trainer: TrainEngine
    buffer: ReplayBuffer
    controller: RolloutController
    publisher: WeightPublisher
    runlog: RunLog
    checkpoints: RunCheckpoints
    config: dict  # the run's config, as config.json holds it (checkpoints carry it)
    code: dict  # the code the run runs (checkpoints carry it)
    before: dict  # held-out accuracy before RL (checkpoints carry it)
    batch_size: int
    eta: int
    warmup_steps: int  # steps left out of the throughput figure
    agents: AgentRouter | None = None
    curriculum_by: str | None = None
    on_step: Callable[[dict], None] | None = None
    stop: object = None  # anything with is_set(): the step under way is the last, checkpointed
    progress: bool = True
    schedule: ScheduleLog | None = None  # records what entered each step (schedule.py), for replays
    costs: CostLedger | None = None  # the cost ledger's step columns and the budget (costs.py)
    lending: CoreLending | None = None  # the trainer borrows idle servers' cores (trainer/core_lending.py)


@dataclass
class LoopResult:
    version: int
    last_step: int
    stopped: bool = False
    budget_spent: bool = False  # stopped because cost.budget_usd was spent
    servers_short: str | None = None  # stopped because fewer than rollout.min_servers are left (why)
    checkpointed: int | None = None  # the last step checkpointed by this loop
    tokens: int = 0  # trained by this process
    start: float = field(default_factory=time.perf_counter)
    end: float = 0.0
    warm: tuple[float, int] | None = None  # (time, tokens so far) once the warm-up steps are done
    first_step: int = 1  # the first step this loop trains


def _lending_shares(lending: CoreLending | None) -> dict[str, float]:
    """Of the trainer's layer passes since the last row, the share that found the servers idle and
    the share that ran on their cores too, and the seconds it computed on its own threads and on
    theirs too (NaN without lending; ``StepShares``)."""
    shares = lending.end_step() if lending is not None else None
    columns = ("trainer_idle_share", "trainer_lent_share", "trainer_own_threads_s", "trainer_lent_threads_s")
    if shares is None:
        return dict.fromkeys(columns, math.nan)
    return dict(zip(columns, (shares.idle, shares.lent, shares.own_s, shares.lent_s), strict=True))


def step_row(step: int, version: int, result: StepResult, batch: list[Trajectory], loop: Loop, generated: int) -> dict:
    """The metrics row of a step: the trainer's figures and what the rollout side did meanwhile."""
    c, agents = loop.controller, loop.agents
    return {
        "step": step,
        "version": version,
        **result.metrics,
        # of the wait for the batch, the part for grades alone (single-turn episodes only: NaN otherwise)
        "reward_wait_s": loop.buffer.last_reward_wait_s if c.measures_reward_wait else math.nan,
        "generated_tokens": generated,
        **_lending_shares(loop.lending),
        # with a curriculum: as of this step's batches (deterministic runs learn in admission order)
        **{f"pass_rate_{b}": p for b, p in c.pass_rates(version * loop.batch_size).items()},
        **{f"mix_{b}": p for b, p in c.curriculum_mix(version * loop.batch_size).items()},
        # multi-turn episodes: answers' turns, and text the environment added (not trained)
        "turns_mean": sum(t.reward_info.get("turns", 1) for t in batch) / len(batch),
        "environment_tokens": sum(len(t.output_mask) - sum(t.output_mask) for t in batch),
        # multi-agent runs: per agent R(a), rewards since the last row, route; trained here
        **c.agent_metrics(),
        **({f"agent_{a}_trained": sum(t.agent_id == a for t in batch) for a in agents.ids} if agents else {}),
    }


def _finish_row(
    row: dict, clock: StepClock, loop: Loop, out: LoopResult, result: StepResult, generated_before: int, commit: bool
) -> None:
    """Complete a step's row with its times so far and, with a ledger, its cost columns; ``commit``:
    the row is final (the ledger counts from its pool figures on), else a checkpoint's copy."""
    row.update(
        {
            "checkpoint_wait_s": 0.0,
            "checkpoint_time_s": 0.0,
            **clock.s,
            **loop.publisher.figures(),
            "step_time_s": clock.elapsed,
            "train_tokens_per_s": result.tokens_trained / clock.elapsed,
            "elapsed_s": time.perf_counter() - out.start,
        }
    )
    if loop.costs is not None:
        generated = loop.controller.generated_tokens - generated_before
        row.update(loop.costs.step_row(row, loop.controller.pool_figures(), generated, commit=commit))


def _show(bar: tqdm, result: StepResult, loop: Loop) -> None:
    # with a curriculum the batch's accuracy is on the prompts the curriculum drew (it moves to
    # harder ones as the policy improves): labelled so, with the mix
    mix = loop.controller.curriculum_mix()
    acc = (
        {"acc": f"{result.accuracy:.2f}"}
        if not mix
        else {"acc_on_mix": f"{result.accuracy:.2f}", "mix": describe_mix(mix, loop.curriculum_by, 2)}
    )
    bar.update(1)
    bar.set_postfix(reward=f"{result.reward:.2f}", **acc, stale=result.staleness_max, len=int(result.answer_len_mean))


def train_steps(loop: Loop, version: int, steps: int) -> LoopResult:
    """Train from ``version`` to step ``steps`` (or to a stop); the servers hold the last version after."""
    # (the start is a checkpoint)
    out = LoopResult(version=version, last_step=version, checkpointed=version, first_step=version + 1)
    bar = tqdm(total=steps, initial=min(version, steps), desc=f"RL {loop.name}", unit="step", disable=not loop.progress)
    with loop.checkpoints, logs_above_the_bar(loop.progress):
        try:
            loop.controller.start()
            if loop.costs is not None:
                loop.costs.start(loop.controller.pool_figures())
            for step in range(version + 1, steps + 1):
                result = _train_step(loop, step, steps, out)
                if result is None:  # the elastic pool is short of servers: stopped at a checkpoint
                    break
                _show(bar, result, loop)
                if out.stopped:
                    break
            loop.runlog.flush()
            loop.publisher.finish()  # the servers hold the final weights before the evaluation
        finally:
            bar.close()
            loop.controller.stop()
            loop.publisher.transport.close()
    out.end = time.perf_counter()
    return out


def _train_step(loop: Loop, step: int, steps: int, out: LoopResult) -> StepResult | None:
    """One step: take a staleness-bounded batch, train it, record its schedule, publish the new
    version (the servers get it while the next batch is taken), log the row, checkpoint when due."""
    version, clock = out.version, StepClock()
    generated_before = loop.controller.generated_tokens
    with clock.part("wait_time_s"):
        batch = _take_or_pause(loop, version, out)
    if batch is None:
        return None
    out.budget_spent = loop.costs is not None and loop.costs.budget_spent(loop.runlog.metrics)
    out.stopped = (loop.stop is not None and loop.stop.is_set()) or out.budget_spent  # this step is the last
    checkpointing = loop.checkpoints.due(step, final=step == steps) or out.stopped
    if checkpointing:
        loop.controller.refresh_partials()  # for the resume state, read while we train
    if any(t.route == FROZEN for t in batch):  # the buffer never holds them: a bug if so
        raise RuntimeError("a frozen-policy trajectory reached the trainer")
    result = loop.trainer.step(batch, version)
    recorded = record_schedule(loop, step, version, batch)
    with clock.part("publish_time_s"):
        loop.publisher.publish(loop.model, version + 1, clock)  # servers get it while we go on
        generated = loop.controller.generated_tokens - generated_before
        row = {**step_row(step, version + 1, result, batch, loop, generated), **clock.s}
        row.update(schedule_bytes=recorded, checkpoint=checkpointing)
        loop.runlog.log_step(row, ledger_rows(batch, step, version, result.prox_version), flush=False)
    if checkpointing:  # weights, optimizer and every untrained answer, as of this step
        with clock.part("checkpoint_time_s"):
            out.checkpointed = step
            row["weights_sha256"] = weights_sha256(loop.model)
            # the resume state holds this row as of now (the write's own time is not in it)
            _finish_row(row, clock, loop, out, result, generated_before, commit=False)
            clock.s["checkpoint_wait_s"] = loop.checkpoints.write(
                step, loop.model, resume_files(loop, step), final=step == steps
            )
    else:
        loop.checkpoints.poll()
    _finish_row(row, clock, loop, out, result, generated_before, commit=True)
    loop.runlog.flush(min_interval_s=METRICS_FLUSH_S)
    out.tokens += result.tokens_trained
    out.version, out.last_step = version + 1, step
    if step == out.first_step - 1 + loop.warmup_steps:
        out.warm = (time.perf_counter(), out.tokens)
    if loop.on_step:
        loop.on_step({**row, "total_steps": steps})
    return result


def _take_or_pause(loop: Loop, version: int, out: LoopResult) -> list[Trajectory] | None:
    """The next batch; None when the elastic pool has fewer servers than ``rollout.min_servers``
    (``controller/elastic.py``): the last step trained is then checkpointed, if it is not yet, with
    every untrained answer (what the servers left had generated of it included), and the run stops."""
    try:
        return loop.buffer.take(loop.batch_size, version, loop.eta)
    except BufferClosed as e:
        if not isinstance(e.__cause__, ServersShort):
            raise
        out.servers_short, out.stopped = str(e.__cause__), True
    log.warning("%s: stopping at step %d", out.servers_short, out.last_step)
    step = out.last_step
    if out.checkpointed != step:
        loop.controller.read_partials_now()
        row = loop.runlog.metrics[-1]
        row["checkpoint"], row["weights_sha256"] = True, weights_sha256(loop.model)
        loop.checkpoints.write(step, loop.model, resume_files(loop, step), final=False)
        out.checkpointed = step
    return None


def record_schedule(loop: Loop, step: int, version: int, batch: list[Trajectory]) -> int:
    """Record step ``step``'s batch (trained by ``version``) in the run's schedule; its bytes (0 without one)."""
    if loop.schedule is None:
        return 0
    seed = loop.config["seed"]
    return loop.schedule.record(
        step,
        version,
        batch,
        [trajectory_seed(seed, t.traj_id) for t in batch],
        getattr(loop.trainer, "last_plan", None),
    )


def resume_files(loop: Loop, step: int) -> dict[str, FileData]:
    """A checkpoint's resume state as of ``step``: sampler, untrained answers, trainer, metrics; and
    the schedule of the steps since the previous checkpoint."""
    files = run_state.encode(
        step,
        loop.config,
        loop.controller.snapshot(),
        loop.trainer.state_dict(),
        loop.runlog.to_parquet_bytes(),
        loop.before,
        loop.code,
    )
    if loop.schedule is not None:
        files[CHECKPOINT_FILE] = loop.schedule.checkpoint_bytes()
    return files


def _writes_to_terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def logs_above_the_bar(enabled: bool):
    """While a progress bar is shown, every logger that writes to the terminal (ours, Prefect's,
    Dask's) writes through tqdm, on its own line above the bar, instead of gluing its lines to it."""
    if not enabled:
        yield
        return
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    with logging_redirect_tqdm([lg for lg in loggers if any(map(_writes_to_terminal, lg.handlers))], tqdm_class=tqdm):
        yield
