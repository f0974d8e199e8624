"""A discrete-event simulation of one RL run: rollout servers, a trainer, weight
updates and the staleness gate, synchronous or asynchronous.

Entry point: `simulate(SimConfig) -> SimResult`.

* **async** (AReaL): `n_rollout_gpus` devices serve, the other `n_gpus - n_rollout_gpus`
  train. The controller admits whole groups while the gate allows it (the rule of
  `areal_core/algo/staleness.py`, paper eq. 3, over the version every server has
  confirmed). The trainer takes a batch as `buffer.py` does: every group due at this
  version (admitted at version <= i - eta) must be in it, the rest are the oldest ready
  groups, and it waits if taking them would leave some older group unable to make its
  deadline. It trains, publishes the new version and takes its next batch while the
  servers load; it waits before publishing the version after that until every server
  has confirmed the previous one.
* **sync** (the baseline): every device serves the step's batch, then every device
  trains on it (after moving the training state back), then the weights go to the
  servers, then the next step starts. Staleness is 0.

The configuration and its validation live in `config.py`, the result and its aggregation
in `result.py`; `SimConfig`, `SimResult`, `resolve` and the mode names are importable from
here as well.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from areal_core.algo.staleness import staleness_allows
from areal_core.sim.config import MODES, Setup, SimConfig, resolve
from areal_core.sim.result import SimResult, collect_result
from areal_core.sim.server import Request, RolloutServer

__all__ = ["MODES", "Setup", "SimConfig", "SimResult", "resolve", "simulate"]


@dataclass
class _Group:
    gid: int
    admit_version: int
    size: int
    done: int = 0
    requests: list[Request] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.done == self.size


class _Run:
    """What both modes share: the event queue, the servers, admission and the results."""

    def __init__(self, cfg: SimConfig, setup: Setup):
        self.cfg, self.setup, self.cost = cfg, setup, setup.cost
        self.rng = np.random.default_rng(cfg.seed)
        self.events: list = []
        self._seq = 0
        self.now = 0.0
        self.servers = [
            RolloutServer(
                k,
                setup.cost,
                setup.tp,
                cfg.weight_update if cfg.mode == "async" else "drain",
                cfg.max_running_per_server,
                cfg.admit_reserve_tokens,
            )
            for k in range(setup.n_servers)
        ]
        self.inflight = np.zeros(setup.n_servers, dtype=np.int64)
        self.n_admitted = 0
        self.groups: OrderedDict[int, _Group] = OrderedDict()  # admitted, not trained
        self.n_groups = 0
        self.steps_done = 0
        self.step_end: list[float] = []
        self.step_tokens: list[int] = []
        self.step_answer_tokens: list[int] = []
        self.train_intervals: list[tuple[float, float]] = []
        self.staleness: list[np.ndarray] = []
        self.n_updates = 0
        self.ready_answers = 0  # answers in finished, untrained groups

    # ---- events ---------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn, args))

    def run(self) -> SimResult:
        self.start()
        while self.steps_done < self.cfg.n_steps:
            if not self.events:
                raise RuntimeError(
                    f"simulation stalled at t={self.now:.1f}s after {self.steps_done} steps "
                    f"({self.n_admitted} admitted, {len(self.groups)} groups untrained)"
                )
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(t, *args)
        return self.result()

    def schedule(self, server: RolloutServer) -> None:
        server.event_token += 1
        t = server.next_event_time()
        if t is not None:
            self.at(t, self._on_server, server, server.event_token)

    def _on_server(self, t: float, server: RolloutServer, token: int) -> None:
        if token != server.event_token:
            return
        done, confirmed = server.touch(t)
        self.after_touch(server, done, confirmed)

    def after_touch(self, server: RolloutServer, done: list[Request], confirmed: float | None) -> None:
        if done:
            when = done[0].done_time
            if when > self.now:  # the server's clock ran to the end of its current step
                self.at(when, self.on_finished, done)
            else:
                self.on_finished(self.now, done)
        if confirmed is not None:
            self.at(confirmed, self.on_confirm, server, server.version)
        self.schedule(server)

    # ---- admission ------------------------------------------------------------------
    def admit_group(self, admit_version: int, touched: set[int]) -> None:
        n = self.cfg.answers_per_prompt
        lengths = self.cfg.lengths.sample(self.rng, n)
        group = _Group(self.n_groups, admit_version, n)
        self.n_groups += 1
        for length in lengths:
            req = Request(self.n_admitted, group.gid, self.cfg.prompt_tokens, int(length), admit_version)
            self.n_admitted += 1
            k = int(np.argmin(self.inflight))
            self.inflight[k] += 1
            req.server = k
            self.servers[k].submit(req)
            group.requests.append(req)
            touched.add(k)
        self.groups[group.gid] = group

    def touch_servers(self, t: float, touched: set[int]) -> None:
        for k in sorted(touched):
            server = self.servers[k]
            done, confirmed = server.touch(t)
            self.after_touch(server, done, confirmed)

    def on_finished(self, t: float, done: list[Request]) -> None:
        for req in done:
            self.inflight[req.server] -= 1
            group = self.groups[req.group]
            group.done += 1
            if group.ready:
                self.ready_answers += group.size
        self.after_finished(t)

    # ---- hooks ----------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def after_finished(self, t: float) -> None:
        raise NotImplementedError

    def on_confirm(self, t: float, server: RolloutServer, version: int) -> None:
        raise NotImplementedError

    # ---- training bookkeeping -------------------------------------------------------
    def train_batch(self, t: float, groups: list[_Group], n_devices: int, version: int, extra_s: float = 0.0) -> float:
        lengths = np.array([r.prompt + r.target for g in groups for r in g.requests], dtype=np.float64)
        firsts = np.array([r.first_version for g in groups for r in g.requests], dtype=np.int64)
        self.staleness.append(version - firsts)
        for g in groups:
            del self.groups[g.gid]
        computed = lengths.sum()
        if self.cfg.train_shared_prompt:  # each group's prompt runs once, its answers attend to it
            computed -= sum(r.prompt for g in groups for r in g.requests[1:])
        dt = self.cost.train_s(computed, float((lengths**2).sum()), n_devices) + extra_s
        self.train_intervals.append((t, t + dt))
        self.step_tokens.append(int(lengths.sum()))
        self.step_answer_tokens.append(sum(r.target for g in groups for r in g.requests))
        return dt

    def result(self) -> SimResult:
        return collect_result(
            self.cfg,
            self.setup,
            self.servers,
            self.step_end,
            self.step_tokens,
            self.step_answer_tokens,
            self.train_intervals,
            self.staleness,
            self.n_updates,
        )


class _AsyncRun(_Run):
    """Rollout and trainer on separate devices, joined by the gate and the buffer."""

    def __init__(self, cfg: SimConfig, setup: Setup):
        super().__init__(cfg, setup)
        self.gate_version = 0  # the version every server has confirmed
        self.published = 0  # the latest version sent to the servers
        self.confirmations: dict[int, int] = {}
        self.trainer_busy = False
        self.blocked_version: int | None = None  # trained, waiting to be published

    def start(self) -> None:
        self.try_admit(0.0)

    def try_admit(self, t: float) -> None:
        cfg = self.cfg
        touched: set[int] = set()
        # the run's own gate (algo/staleness.py, AReaL eq. 3), for a group's last request
        while staleness_allows(
            self.n_admitted + cfg.answers_per_prompt - 1, self.gate_version, cfg.batch_size, cfg.eta
        ):
            self.admit_group(self.gate_version, touched)
        self.touch_servers(t, touched)

    def after_finished(self, t: float) -> None:
        self.try_train(t)

    # ---- trainer --------------------------------------------------------------------
    def take(self, version: int) -> list[_Group] | None:
        """The batch for the trainer at `version`, or None if it must wait (buffer.py)."""
        cfg = self.cfg
        per_batch = cfg.prompts_per_step
        batch: list[_Group] = []
        due = True
        for group in self.groups.values():
            if due and group.admit_version + cfg.eta <= version:
                if not group.ready:
                    return None
                batch.append(group)
                continue
            due = False
            if len(batch) >= per_batch:
                break
            if group.ready:
                batch.append(group)
        if len(batch) > per_batch:
            raise RuntimeError(f"{len(batch)} groups fell due at version {version}: the gate was exceeded")
        if len(batch) < per_batch:
            return None
        chosen = {g.gid for g in batch}
        deadlines = np.array([g.admit_version + cfg.eta for g in self.groups.values() if g.gid not in chosen])
        if deadlines.size and np.any(np.arange(1, deadlines.size + 1) > (deadlines - version) * per_batch):
            return None  # an older group could no longer make its deadline
        return batch

    def try_train(self, t: float) -> None:
        if self.trainer_busy or self.blocked_version is not None or self.steps_done >= self.cfg.n_steps:
            return
        if self.ready_answers < self.cfg.batch_size:
            return
        version = self.steps_done
        batch = self.take(version)
        if batch is None:
            return
        self.ready_answers -= self.cfg.batch_size
        self.trainer_busy = True
        dt = self.train_batch(t, batch, self.setup.n_trainer_gpus, version)
        self.at(t + dt, self.on_trained)

    def on_trained(self, t: float) -> None:
        self.trainer_busy = False
        self.steps_done += 1
        self.step_end.append(t)
        if self.steps_done >= self.cfg.n_steps:
            return
        if self.gate_version == self.published:
            self.publish(t, self.steps_done)
            self.try_train(t)
        else:
            self.blocked_version = self.steps_done

    def publish(self, t: float, version: int) -> None:
        self.published = version
        self.n_updates += 1
        for server in self.servers:
            done, confirmed = server.begin_update(version, t)
            self.after_touch(server, done, confirmed)

    def on_confirm(self, t: float, server: RolloutServer, version: int) -> None:
        self.confirmations[version] = self.confirmations.get(version, 0) + 1
        if self.confirmations[version] < len(self.servers):
            return
        del self.confirmations[version]
        self.gate_version = version
        self.try_admit(t)
        if self.blocked_version is not None:
            version, self.blocked_version = self.blocked_version, None
            self.publish(t, version)
            self.try_train(t)


class _SyncRun(_Run):
    """Every device generates the batch, then every device trains on it."""

    def start(self) -> None:
        self.begin_step(0.0)

    def begin_step(self, t: float) -> None:
        touched: set[int] = set()
        for _ in range(self.cfg.prompts_per_step):
            self.admit_group(self.steps_done, touched)
        self.touch_servers(t, touched)

    def after_finished(self, t: float) -> None:
        if self.ready_answers < self.cfg.batch_size:
            return
        self.ready_answers = 0
        version = self.steps_done
        dt = self.train_batch(
            t, list(self.groups.values()), self.setup.n_rollout_gpus, version, extra_s=self.cost.colocate_switch_s
        )
        self.at(t + dt, self.on_trained)

    def on_trained(self, t: float) -> None:
        self.steps_done += 1
        self.n_updates += 1
        end = t + self.cost.weight_update_s  # every server loads the new weights, idle
        for server in self.servers:
            server.advance(end)
            server.version = self.steps_done
        self.step_end.append(end)
        if self.steps_done < self.cfg.n_steps:
            self.at(end, self.begin_step)

    def on_confirm(self, t: float, server: RolloutServer, version: int) -> None:
        return None  # servers load between steps, while idle: nothing to confirm


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated RL run (see the module docstring)."""
    setup = resolve(cfg)
    run = (_AsyncRun if cfg.mode == "async" else _SyncRun)(cfg, setup)
    return run.run()
