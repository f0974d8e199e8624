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
"""

from __future__ import annotations

import heapq
import typing
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from areal_core.algo.staleness import staleness_allows
from areal_core.rollout.protocol import WeightUpdateMode
from areal_core.sim.cost import (
    CostModel,
    Efficiency,
    build_cost_model,
    check_rollout_fits,
    check_trainer_fits,
    smallest_rollout_tp,
)
from areal_core.sim.hardware import GPUSpec, ModelSpec, gpu_spec, model_spec
from areal_core.sim.lengths import LengthDist
from areal_core.sim.server import Request, RolloutServer

MODES = ("async", "sync")
UPDATE_MODES = typing.get_args(WeightUpdateMode)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Counts are devices (GPUs); lengths are tokens.

    Attributes:
        model: a `ModelSpec` or a preset name ("1.5B", "7B", "32B").
        gpu: a `GPUSpec` or a preset name ("H800", "H100", "A100", "H200").
        n_gpus: devices in all.
        mode: "async" (devices split between rollout and trainer) or "sync".
        n_rollout_gpus: async: devices serving (default: 3/4 of n_gpus, AReaL's split).
        rollout_tp: devices per rollout server (default: the fewest that hold the model
            and one full-length sequence).
        eta: maximum staleness (async; sync is eta 0 by construction).
        weight_update: what an update does to answers in flight: reprefill, keep_kv, drain.
        prompts_per_step: prompts per training batch.
        answers_per_prompt: answers per prompt (a group; admitted and trained whole).
        prompt_tokens: prompt length.
        lengths: the answer-length distribution (clipped at its max_new_tokens).
        n_steps: training steps to simulate.
        warmup_steps: steps left out of the effective throughput (pipeline fill).
        seed: seeds the answer lengths (the same seed gives the same lengths in
            admission order, whatever the mode).
        efficiency: achieved fractions and overheads for the roofline cost model.
        cost: a ready `CostModel` (e.g. from `calibrate_from`) used instead of the roofline.
        max_running_per_server: continuous-batching cap on running requests per server.
        admit_reserve_tokens: KV a server keeps free per running request when admitting.
        util_bins: points in the utilisation time series.
        train_shared_prompt: the trainer computes a group's prompt once (this project's
            trainer does; AReaL's packs every answer with its own copy): the training
            cost's token count holds each group's prompt once. The trained-token
            throughput counts it per answer either way.
    """

    model: ModelSpec | str = "7B"
    gpu: GPUSpec | str = "H800"
    n_gpus: int = 64
    mode: str = "async"
    n_rollout_gpus: int | None = None
    rollout_tp: int | None = None
    eta: int = 4
    weight_update: str = "reprefill"
    prompts_per_step: int = 512
    answers_per_prompt: int = 16
    prompt_tokens: int = 1024
    lengths: LengthDist = field(default_factory=lambda: LengthDist(max_new_tokens=15360, median=4000, sigma=0.9))
    n_steps: int = 20
    warmup_steps: int = 5
    seed: int = 0
    efficiency: Efficiency = field(default_factory=Efficiency)
    cost: CostModel | None = None
    max_running_per_server: int = 1024
    admit_reserve_tokens: int = 512
    util_bins: int = 100
    train_shared_prompt: bool = False

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.answers_per_prompt


@dataclass(frozen=True)
class Setup:
    """A validated `SimConfig` with everything derived from it."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int
    n_rollout_gpus: int
    n_trainer_gpus: int
    n_servers: int
    cost: CostModel


def resolve(cfg: SimConfig) -> Setup:
    """Validate `cfg`; every error is a ValueError that names the field."""
    if cfg.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    if cfg.weight_update not in UPDATE_MODES:
        raise ValueError(f"weight_update must be one of {UPDATE_MODES}, got {cfg.weight_update!r}")
    for name in ("n_gpus", "prompts_per_step", "answers_per_prompt", "n_steps", "max_running_per_server", "util_bins"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("eta", "prompt_tokens", "warmup_steps", "admit_reserve_tokens"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.warmup_steps >= cfg.n_steps:
        raise ValueError(f"warmup_steps must be < n_steps ({cfg.n_steps}), got {cfg.warmup_steps}")
    if not isinstance(cfg.lengths, LengthDist):
        raise ValueError(f"lengths must be a LengthDist, got {type(cfg.lengths).__name__}")
    model, gpu = model_spec(cfg.model), gpu_spec(cfg.gpu)
    seq_tokens = cfg.prompt_tokens + cfg.lengths.max_new_tokens
    if cfg.rollout_tp is None:
        tp = smallest_rollout_tp(model, gpu, seq_tokens, cfg.efficiency)
    elif cfg.rollout_tp < 1:
        raise ValueError(f"rollout_tp must be >= 1, got {cfg.rollout_tp}")
    else:
        tp = cfg.rollout_tp
    if cfg.mode == "sync":
        n_rollout, n_trainer = cfg.n_gpus, cfg.n_gpus
        if cfg.n_gpus % tp:
            raise ValueError(f"n_gpus ({cfg.n_gpus}) must be a multiple of rollout_tp ({tp}) in sync mode")
    else:
        n_rollout = cfg.n_rollout_gpus if cfg.n_rollout_gpus is not None else _default_rollout(cfg.n_gpus, tp)
        if n_rollout >= cfg.n_gpus:
            raise ValueError(
                f"n_rollout_gpus: {n_rollout} of n_gpus {cfg.n_gpus} leaves no trainer device (async needs both)"
            )
        if n_rollout < tp:
            raise ValueError(
                f"n_rollout_gpus: {n_rollout} leaves no rollout server (one needs rollout_tp = {tp} devices)"
            )
        if n_rollout % tp:
            raise ValueError(f"n_rollout_gpus ({n_rollout}) must be a multiple of rollout_tp ({tp})")
        n_trainer = cfg.n_gpus - n_rollout
    check_rollout_fits(model, gpu, tp, seq_tokens, cfg.efficiency)
    check_trainer_fits(model, gpu, n_trainer, cfg.efficiency, field="n_gpus" if cfg.mode == "sync" else "n_trainer_gpus")
    switch_devices = cfg.n_gpus if cfg.mode == "sync" else 0
    cost = cfg.cost or build_cost_model(model, gpu, tp, cfg.efficiency, train_devices_for_switch=switch_devices)
    if cost.kv_capacity_tokens < seq_tokens:
        raise ValueError(
            f"cost.kv_capacity_tokens ({cost.kv_capacity_tokens}) is below one full sequence "
            f"(prompt_tokens + lengths.max_new_tokens = {seq_tokens})"
        )
    return Setup(model, gpu, tp, n_rollout, n_trainer, n_rollout // tp, cost)


def _default_rollout(n_gpus: int, tp: int) -> int:
    n = (3 * n_gpus // 4) // tp * tp
    return max(n, tp)


@dataclass
class SimResult:
    """What one simulated run gives.

    Attributes:
        mode, eta, weight_update, n_rollout_gpus, n_trainer_gpus, rollout_tp: the setting.
        wall_time_s: time at which the last step's training ended.
        step_end_s: end time of every training step.
        step_train_s: how long each step's training took (its trainer time).
        trained_tokens: prompt + answer tokens trained over the run.
        effective_throughput: trained tokens/s over the steps after `warmup_steps`.
        effective_answer_throughput: the same counting answer tokens only (what the
            project's `effective_train_tokens_per_s` counts).
        overall_throughput: trained tokens / wall time.
        generation_throughput: answer tokens generated / wall time (all servers).
        staleness: per trained answer, the trainer's version minus the version of the
            answer's oldest token.
        util_t: bin centres of the utilisation series (s).
        rollout_busy: share of rollout devices generating (decode or prefill), per bin.
        trainer_busy: share of trainer devices training, per bin.
        n_weight_updates: versions published to the servers.
        n_retracted: requests pushed back to a queue because the KV cache was full.
    """

    mode: str
    eta: int
    weight_update: str
    n_rollout_gpus: int
    n_trainer_gpus: int
    rollout_tp: int
    wall_time_s: float
    step_end_s: np.ndarray
    step_train_s: np.ndarray
    trained_tokens: int
    effective_throughput: float
    effective_answer_throughput: float
    overall_throughput: float
    generation_throughput: float
    staleness: np.ndarray
    util_t: np.ndarray
    rollout_busy: np.ndarray
    trainer_busy: np.ndarray
    n_weight_updates: int
    n_retracted: int

    @property
    def staleness_mean(self) -> float:
        return float(self.staleness.mean()) if self.staleness.size else 0.0

    @property
    def staleness_max(self) -> int:
        return int(self.staleness.max()) if self.staleness.size else 0

    def staleness_histogram(self) -> dict[int, int]:
        values, counts = np.unique(self.staleness, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}

    @property
    def rollout_util(self) -> float:
        return float(self.rollout_busy.mean())

    @property
    def trainer_util(self) -> float:
        return float(self.trainer_busy.mean())

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "eta": self.eta,
            "weight_update": self.weight_update,
            "n_rollout_gpus": self.n_rollout_gpus,
            "n_trainer_gpus": self.n_trainer_gpus,
            "rollout_tp": self.rollout_tp,
            "wall_time_s": round(self.wall_time_s, 2),
            "effective_throughput": round(self.effective_throughput, 1),
            "effective_answer_throughput": round(self.effective_answer_throughput, 1),
            "generation_throughput": round(self.generation_throughput, 1),
            "staleness_mean": round(self.staleness_mean, 3),
            "staleness_max": self.staleness_max,
            "rollout_util": round(self.rollout_util, 3),
            "trainer_util": round(self.trainer_util, 3),
        }


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
            RolloutServer(k, setup.cost, setup.tp, cfg.weight_update if cfg.mode == "async" else "drain",
                          cfg.max_running_per_server, cfg.admit_reserve_tokens)
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
        cfg, setup = self.cfg, self.setup
        wall = self.step_end[-1]
        ends = np.asarray(self.step_end)
        tokens = np.asarray(self.step_tokens, dtype=np.float64)
        w = cfg.warmup_steps
        t0 = ends[w - 1] if w > 0 else 0.0
        effective = tokens[w:].sum() / (ends[-1] - t0)
        answers = np.asarray(self.step_answer_tokens, dtype=np.float64)
        edges = np.linspace(0.0, wall, cfg.util_bins + 1)
        rollout = np.zeros(cfg.util_bins)
        for server in self.servers:
            rollout += server.tp * _busy_per_bin(server.busy, edges)
        rollout /= setup.n_rollout_gpus * np.diff(edges)
        trainer = _busy_per_bin(self.train_intervals, edges) / np.diff(edges)
        return SimResult(
            mode=cfg.mode,
            eta=cfg.eta if cfg.mode == "async" else 0,
            weight_update=cfg.weight_update if cfg.mode == "async" else "drain",
            n_rollout_gpus=setup.n_rollout_gpus,
            n_trainer_gpus=setup.n_trainer_gpus,
            rollout_tp=setup.tp,
            wall_time_s=float(wall),
            step_end_s=ends,
            step_train_s=np.array([b - a for a, b in self.train_intervals]),
            trained_tokens=int(tokens.sum()),
            effective_throughput=float(effective),
            effective_answer_throughput=float(answers[w:].sum() / (ends[-1] - t0)),
            overall_throughput=float(tokens.sum() / wall),
            generation_throughput=float(sum(s.generated_tokens for s in self.servers) / wall),
            staleness=np.concatenate(self.staleness) if self.staleness else np.zeros(0, dtype=np.int64),
            util_t=(edges[:-1] + edges[1:]) / 2,
            rollout_busy=np.clip(rollout, 0.0, 1.0),
            trainer_busy=np.clip(trainer, 0.0, 1.0),
            n_weight_updates=self.n_updates,
            n_retracted=sum(s.retracted for s in self.servers),
        )


def _busy_per_bin(intervals, edges: np.ndarray) -> np.ndarray:
    """Busy seconds of a set of disjoint intervals in each bin."""
    if not intervals:
        return np.zeros(len(edges) - 1)
    arr = np.asarray(intervals, dtype=np.float64)
    start, length = arr[:, 0], arr[:, 1] - arr[:, 0]
    covered = np.clip(edges[:, None] - start[None, :], 0.0, length[None, :]).sum(axis=1)
    return np.diff(covered)


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
        while staleness_allows(self.n_admitted + cfg.answers_per_prompt - 1, self.gate_version, cfg.batch_size,
                               cfg.eta):
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
        dt = self.train_batch(t, list(self.groups.values()), self.setup.n_rollout_gpus, version,
                              extra_s=self.cost.colocate_switch_s)
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
