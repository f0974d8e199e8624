"""The rollout controller: paces generation with the staleness gate and dispatches rewards.

It runs an asyncio loop in a background thread. For each prompt it admits a group of n answers
only while the staleness gate holds (``admission.py``), has the episode generate them on a
rollout server (``generation.py``: one batched request, continued and resubmitted until done, with
nothing lost when a server dies), and submits the group's grading to the Dask reward service as one
task the moment its last answer is in, without waiting for it (the buffer hands out whole groups, so
grading them one by one would only cost scheduler round trips). Rewarded trajectories land in the
replay buffer. Multi-agent runs route some groups to a frozen policy (``routing.py``); episodes see
the controller through ``episode_context.py``; ``snapshot()`` and ``restore()`` (``resume.py``)
carry what was admitted and not trained across a restart."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from areal_core.controller import resume
from areal_core.controller.admission import Admission
from areal_core.controller.agents import FROZEN, TRAINABLE
from areal_core.controller.buffer import ReplayBuffer
from areal_core.controller.elastic import watch_pool
from areal_core.controller.episode_context import EpisodeContextOf
from areal_core.controller.generation import ROUTE, Generator
from areal_core.controller.grading import Grader
from areal_core.controller.recovery import ServerRecovery
from areal_core.controller.routing import FrozenGroups
from areal_core.controller.settings import AgentSetup, ControllerSettings, Servers
from areal_core.episodes import Episode, SingleTurn
from areal_core.reward.result import RewardResult
from areal_core.rollout.backends import default_client
from areal_core.types import Trajectory

log = logging.getLogger(__name__)


class RolloutController:
    """``servers``: the trainable policy's; ``transport`` moves new weights to them
    (``update_weights``); ``decode``/``encode``: token ids <-> response text (``encode`` only for
    episodes that add text to an answer); ``agents``: a multi-agent run's routing."""

    def __init__(
        self,
        servers: Servers,
        decode: Callable,
        buffer: ReplayBuffer,
        settings: ControllerSettings,
        admission: Admission,
        generator: Generator,
        recovery: ServerRecovery,
        grader: Grader,
        *,
        episode: Episode | None = None,
        encode: Callable | None = None,
        agents: AgentSetup | None = None,
        frozen: FrozenGroups | None = None,
    ):
        """The parts (``make_controller`` builds them from a run's settings): ``admission`` draws
        prompts past the staleness gate, ``generator`` has them answered, ``recovery`` pushes weights
        and brings servers back, ``grader`` grades answers; ``frozen``: a multi-agent run's groups on
        the frozen policy."""
        self.servers, self.decode, self.encode = servers, decode, encode
        self.episode = episode or SingleTurn()
        # a single-turn answer's grade is its last: the buffer can tell how long the trainer waits on grades
        self.measures_reward_wait = type(self.episode) is SingleTurn
        self.buffer, self.s, self.agents = buffer, settings, agents
        self.admission, self.generator, self.recovery, self.grader = admission, generator, recovery, grader
        self.frozen = frozen
        self._live: dict[str, Trajectory] = {}  # admitted, not yet in the buffer
        self._lock = threading.Lock()  # _live, tallies + buffer.put (reward callbacks run in Dask threads)
        self._restored: list[Trajectory] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()  # the groups being rolled out (the loop holds tasks weakly)

    @property
    def version(self) -> int:
        return self.admission.version

    @property
    def generated_tokens(self) -> int:
        return self.generator.generated_tokens

    @property
    def resubmitted(self) -> int:
        return self.generator.resubmitted

    @property
    def frozen_generated(self) -> int:
        return self.frozen.generated if self.frozen is not None else 0

    # lifecycle (called from the trainer's thread) -------------------------
    def start(self) -> RolloutController:
        """Start generating; returns once the weight transport is connected (or raises why not)."""
        self._thread = threading.Thread(target=self._thread_main, name="rollout-controller", daemon=True)
        self._thread.start()
        self._ready.wait()
        try:
            self._call(self._wait_connected())
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_connected(self) -> None:
        await self._connected

    def stop(self) -> None:
        """Stop admitting, abandon in-flight requests, close connections."""
        if self._loop is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        fut.result(timeout=60)
        self._thread.join(timeout=60)
        self._loop = None

    def update_weights(self, version: int) -> Future:
        """Push the weights staged in the transport (as ``version``) to every server; the gate
        moves once all have them.

        Returns at once: the future resolves when the update is done (or raises its
        error), so the trainer can start its next step meanwhile. The caller stages the
        next version only after this future resolved.

        With agents, every ``every_steps``-th version (trainer step) first re-selects the agents
        routed to the trainable policy; groups admitted from then on follow the new table."""
        assert self._loop is not None, "controller not started"
        router = self.agents.router if self.agents is not None else None
        if router is not None and router.maybe_select(version):
            log.info("step %d: agents on the trainable policy: %s", version, router.selections[-1]["trainable"])
        return asyncio.run_coroutine_threadsafe(self._update_weights(version), self._loop)

    async def _update_weights(self, version: int) -> None:
        if self.s.deterministic:  # waves up to (version - 1) + eta are generated at version - 1
            await self._waves_rewarded((version + self.s.eta) * self.s.batch_size)
        await self.recovery.push(version)
        await self.admission.advance(version)

    async def _waves_rewarded(self, bound: int) -> None:
        """Until the trajectories with seq_no < ``bound`` are all admitted and rewarded."""

        def done() -> bool:
            with self._lock:
                return self.admission.n_submitted >= bound and all(t.seq_no >= bound for t in self._live.values())

        while not done():  # noqa: ASYNC110 - rewards arrive on Dask threads; a short poll is simplest
            await asyncio.sleep(0.002)

    def pool_figures(self) -> dict:
        """For the cost ledger: the servers' generating seconds and re-prefilled positions since they
        started (None if unknown), the time admission was held at the gate, and the server count."""
        busy, again = asyncio.run_coroutine_threadsafe(self.generator.busy(), self._loop).result(timeout=30)
        return {
            "busy_s": busy,
            "reprefilled_tokens": again,
            "gate_wait_s": self.admission.gate_wait_s,
            "n_servers": len(self.generator.pools[TRAINABLE].live()),
        }

    def generating(self) -> bool:
        """Whether any generate request is awaiting its answer now (callable from any thread)."""
        return any(any(p.in_flight) for p in list(self.generator.pools.values()))

    def held_at_gate(self) -> bool:
        """Whether admission waits at the staleness gate now: no new generate request before the
        trainer's next version reaches the servers (callable from any thread)."""
        return self.admission.held

    def live_urls(self) -> list[str]:
        """The trainable servers in the pool now (an elastic pool's change as servers leave and join)."""
        return [c.url for c in self.generator.pools[TRAINABLE].live()]

    def pool_changes(self) -> dict:
        """The servers that left and joined the trainable pool, and the tokens kept of dead servers' answers."""
        return {
            "left": list(self.recovery.left),
            "joined": list(self.recovery.joined),
            "prefix_kept_tokens": self.generator.prefix_kept,
        }

    def restart_from(self, local_copy: Callable[[], str], version: int) -> None:
        """A newer checkpoint for servers that must be restarted: ``local_copy()`` gives its folder
        (a download, made only when a server restarts)."""
        self.recovery.restart_from(local_copy, version)

    def read_partials_now(self) -> None:
        """``refresh_partials``, waiting for the answers."""
        self._call(self.read_partials())

    def refresh_partials(self) -> None:
        """Ask the servers, in the background, for the partial output of the answers they
        are generating; the next ``snapshot()`` includes what has come back by then."""
        assert self._loop is not None, "controller not started"
        fut = asyncio.run_coroutine_threadsafe(self.read_partials(), self._loop)
        fut.add_done_callback(resume.log_refresh_error)

    def snapshot(self) -> dict:
        """Everything admitted and not yet trained, and the stream position (JSON-friendly).

        Call it from the trainer's thread between two ``take``s; see the module docstring."""
        return self._call(self._snapshot())

    def restore(self, state: dict) -> None:
        """Put back a ``snapshot()`` (before ``start()``)."""
        if self._loop is not None:
            raise RuntimeError("restore() must come before start()")
        resume.restore(self, state)

    def _call(self, coro):
        assert self._loop is not None, "controller not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # the event loop -------------------------------------------------------
    def _thread_main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self.generator.open(self.servers, self.agents.frozen if self.agents is not None else None)
        self._connected = self._loop.create_task(self.recovery.connect())
        self._main = self._loop.create_task(self._generate_once_connected())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _generate_once_connected(self) -> None:
        try:
            await self._connected
        except Exception:  # noqa: BLE001 - not lost: start() raises it (and stops the controller)
            return
        groups: dict[str, list[Trajectory]] = {}
        for traj in self._restored:  # the unrewarded answers of each group go on together
            groups.setdefault(traj.group_id, []).append(traj)
        for trajs in groups.values():
            self._spawn(trajs, fresh=False)
        self._restored = []
        if self.s.min_servers is not None or self.servers.discover is not None:  # an elastic pool
            make = self.servers.make_client or default_client
            self.spawn(
                watch_pool(
                    self,
                    self.servers.discover,
                    self.s.min_servers,
                    lambda url: make(url, self.servers.request_timeout_s),
                )
            )
        await self._admit_loop()

    def _spawn(self, trajs: list[Trajectory], fresh: bool, route: str = TRAINABLE) -> None:
        self.spawn(self._run_group(trajs, fresh, route))

    def spawn(self, coro) -> None:
        """Run ``coro`` as a task of this loop (cancelled when the controller stops)."""
        t = self._loop.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _admit_loop(self) -> None:
        n, router = self.s.n_samples, self.agents.router if self.agents is not None else None
        try:
            while True:
                # with agents: the next group is the next agent's (round robin), on the policy its
                # route names now; a frozen group waits for a frozen slot instead of the gate
                agent = router.agent_for(self.admission.n_groups) if router is not None else ""
                route = router.route(agent) if agent else TRAINABLE
                await (self.frozen.acquire() if route == FROZEN else self.admission.wait())
                if agent and router.route(agent) != route:  # re-selected while waiting
                    if route == FROZEN:
                        self.frozen.release()
                    continue
                with self._lock:  # the sampler's pass rates change in reward callbacks
                    gid, prompt = self.admission.draw(trainable=route == TRAINABLE)
                prompt_ids = self.agents.prompt if agent and self.agents.prompt else None
                ids = prompt_ids(agent, prompt) if prompt_ids else list(prompt.input_ids)
                if route == FROZEN:  # not gated, not buffered, never trained: recorded per agent
                    self.frozen.started()
                    self._spawn(
                        [
                            Trajectory(
                                traj_id=f"{gid}-s{k}",
                                group_id=gid,
                                seq_no=-1,
                                admit_version=self.agents.frozen_version,
                                prompt_ids=list(ids),
                                reference=prompt.reference,
                                task=prompt.task,
                                agent_id=agent,
                                route=FROZEN,
                            )
                            for k in range(n)
                        ],
                        fresh=True,
                        route=FROZEN,
                    )
                    continue
                first = self.admission.n_submitted
                self.admission.n_submitted += n
                self.buffer.admit(gid, first, self.version, n)
                trajs = [
                    Trajectory(
                        traj_id=f"{gid}-s{k}",
                        group_id=gid,
                        seq_no=first + k,
                        admit_version=self.version,
                        prompt_ids=list(ids),
                        reference=prompt.reference,
                        task=prompt.task,
                        agent_id=agent,
                        route=TRAINABLE if agent else "",
                    )
                    for k in range(n)
                ]
                for traj in trajs:
                    self._live[traj.traj_id] = traj
                self._spawn(trajs, fresh=True)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # reported to the trainer, which stops the run
            log.exception("rollout admission failed")
            self.buffer.fail(e)

    async def _run_group(self, trajs: list[Trajectory], fresh: bool, route: str = TRAINABLE) -> None:
        """Roll out a fresh group through the episode (the built-in one: every answer in one batched
        request, graded together); a restored group's unfinished answers are finished and graded as
        they are. ``route``: the policy whose servers generate it (this task's and its turns'); a
        frozen group's verdicts are recorded for its agent, never put in the buffer."""
        ROUTE.set(route)
        try:
            if fresh:
                results = await self.episode.run(trajs, EpisodeContextOf(self))
            else:
                await asyncio.gather(*(self.generator.finish(t) for t in trajs))
                results = await self._grade(trajs, [self.decode(t.output_ids) for t in trajs], final=True)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the trainer (buffer.fail wakes it)
            log.error("rollout of group %s failed: %r", trajs[0].group_id, e)
            self.buffer.fail(e)
            return
        finally:
            if route == FROZEN:
                self.frozen.done()
        for t, r in zip(trajs, results, strict=True):
            self._rewarded(t, r, route)

    def _rewarded(self, traj: Trajectory, result: RewardResult, route: str = TRAINABLE) -> None:
        """A verdict: a trainable answer goes to the buffer (and the curriculum's tally); a frozen one's
        is recorded for its agent, nothing else."""
        with self._lock:
            self.grader.verdict(traj, result)
            if route == FROZEN:
                self.frozen.record(traj)
                return
            self._live.pop(traj.traj_id, None)
            self.admission.count(traj)
            if self.agents is not None and traj.agent_id:
                self.agents.router.record(traj.agent_id, traj.reward, traj.correct, TRAINABLE)
            self.buffer.put(traj)

    # rewards ------------------------------------------------------------------
    def _grade(self, trajs: Sequence[Trajectory], texts: Sequence[str], final: bool = False) -> asyncio.Future:
        """Grade ``texts`` (one answer per trajectory of one group) as one batch of reward tasks.
        ``final`` (or a single-turn run): these are the answers' last grades, which the buffer notes."""
        if final or self.measures_reward_wait:
            self.buffer.grading(trajs[0].group_id, [t.traj_id for t in trajs])
        return self.grader.grade(trajs, texts, self._loop)

    # what the run loop reads --------------------------------------------------------
    def agent_metrics(self) -> dict:
        """Per-agent columns for a metrics row (``AgentRouter.step_metrics``) and the frozen side's
        counts; empty without agents."""
        if self.agents is None:
            return {}
        with self._lock:
            return {**self.agents.router.step_metrics(), **self.frozen.metrics()}

    def curriculum_mix(self, trained: int | None = None) -> dict[str, float]:
        """The probability of each bucket in the curriculum's next draw (empty without one), as of
        ``trained`` trajectories trained (None: those handed to the trainer so far)."""
        with self._lock:
            return self.admission.settled(self.buffer.handed_out if trained is None else trained).mix()

    def pass_rates(self, trained: int | None = None) -> dict[str, float]:
        """The curriculum's running pass rate per bucket (empty without a curriculum), as of ``trained``."""
        with self._lock:
            return self.admission.settled(self.buffer.handed_out if trained is None else trained).estimates()

    # resume ------------------------------------------------------------------
    async def read_partials(self) -> None:
        with self._lock:
            asked_at = {tid: len(t.output_ids) for tid, t in self._live.items() if not t.finished}
        self.generator.partials = await self.generator.partial_outputs(asked_at)

    async def _snapshot(self) -> dict:
        return resume.snapshot(self)  # on the loop, so admission and generation cannot interleave

    async def _shutdown(self) -> None:
        # every task of this loop: admission, generation, and a partial-output read still running
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.generator.close()
        self._loop.call_soon(self._loop.stop)
