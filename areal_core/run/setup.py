"""One experiment, top to bottom: warm start, serve, generate asynchronously, train, publish.

    records -> model (+ supervised warm start) -> publish v0 -> rollout servers + Dask
    -> held-out accuracy before -> controller (background) ->
    for each step: take B trajectories (staleness-bounded) -> PPO step -> stage v+1
                   -> the transport pushes v+1 to the servers while the trainer takes
                      its next batch; the gate moves once they have it
                   -> every checkpoint_every steps: a checkpoint, written in the background
    -> held-out accuracy after -> metrics.parquet, ledger.parquet, summary.json

Weights reach the servers every step through the weight transport (memory, not files);
checkpoints follow ``storage.checkpoint_every`` and are written in the background, each
with the run's resumable state (``storage/run_state.py``); ``resume=True`` continues from
the latest one and redoes the steps after it (docs/OPERATIONS.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from areal_core.cluster.pools import reward_service, rollout_backend, weight_transport, with_run_folder
from areal_core.controller import AgentSetup, ControllerSettings, Servers
from areal_core.controller.agents import AgentRouter, agent_prompter
from areal_core.controller.assemble import make_controller
from areal_core.controller.buffer import ReplayBuffer
from areal_core.controller.elastic import url_list
from areal_core.data.datasets import bucket, load_records, to_prompts
from areal_core.device import resolve_device
from areal_core.episodes import make_episode
from areal_core.experiment import ExperimentConfig, upgraded_config
from areal_core.models import build_char_tokenizer, load_base_model, load_optimizer_moments
from areal_core.models.loading import model_dtype, servers_model_dtype
from areal_core.numerics import cpu_kind, require_repeatable
from areal_core.rollout.auth import new_key
from areal_core.rollout.weight_layout import dtype_name
from areal_core.rollout.weight_transport import ADAPTER_BACKENDS, make_transport
from areal_core.run.budget import (
    check_agent_budget,
    check_trajectory_budget,
    servers_kv_budget,
    trajectory_token_limit,
)
from areal_core.run.checkpoints import RunCheckpoints, restore_weights
from areal_core.run.costs import CostLedger
from areal_core.run.costs import write_parquet as write_costs
from areal_core.run.folder import check_run_folder, code_version
from areal_core.run.heldout import heldout_after, heldout_before
from areal_core.run.loop import Loop, WeightPublisher, train_steps
from areal_core.run.metrics import RunLog
from areal_core.run.parts import Policy, Pools, RunSetup, Training
from areal_core.run.schedule import ScheduleLog
from areal_core.run.summary import build_summary
from areal_core.startup import entered_together
from areal_core.storage import CheckpointStore, run_state, write_json_atomic
from areal_core.trainer.backends import make_trainer
from areal_core.trainer.core_lending import CoreLending, lent_threads
from areal_core.trainer.published import as_base, published, trainable

log = logging.getLogger(__name__)


class RunStopped(Exception):
    """The run was asked to stop (``stop``, e.g. Ctrl-C), spent its ``cost.budget_usd`` or has fewer
    rollout servers than ``rollout.min_servers``, and did:
    ``step`` was trained and checkpointed."""

    def __init__(self, step: int, budget: float | None = None, servers_short: str | None = None):
        why = "" if budget is None else f": cost.budget_usd ({budget:g} USD) spent; raise it to continue"
        if servers_short:
            why = f": {servers_short}; resume once servers are back"
        super().__init__(f"stopped at step {step}{why}")
        self.step, self.budget, self.servers_short = step, budget, servers_short


def trainer_torch_threads(cfg: ExperimentConfig, cores: int) -> int:
    """The trainer's share of the cores: set, or all of them when generation is idle while it
    trains (synchronous: eta 0 and drain), else what the embedded servers leave (>= 1)."""
    if cfg.trainer.torch_threads is not None:
        return cfg.trainer.torch_threads
    r = cfg.rollout
    if cfg.trainer.eta == 0 and r.weight_update == "drain":
        return cores
    frozen = 1 if cfg.multi_agent is not None and cfg.multi_agent.needs_frozen_server else 0  # its own server
    servers_here = r.n_servers if cfg.cluster.kind == "local" else 0  # (on Slurm they run on other nodes)
    busy = r.torch_threads * (servers_here + frozen) if r.backend.kind == "embedded" else 0
    return max(1, cores - busy)


def _frozen_launch(cfg: ExperimentConfig, engine, run_dir: Path, model_path: str, api_key: str):
    """The frozen policy's server (multi-agent runs that route agents to it): one embedded server
    holding ``model_path`` (checkpoint v0) with a seed of its own and the run's key; nothing without one."""
    if cfg.multi_agent is None or not cfg.multi_agent.needs_frozen_server:
        return contextlib.nullcontext([]), None
    from areal_core.rollout.backends.embedded.launcher import EmbeddedBackend, server_seed

    (run_dir / "frozen").mkdir(parents=True, exist_ok=True)
    frozen = EmbeddedBackend(
        1,
        engine.model_copy(update={"seed": server_seed(cfg.seed, 1_000_003)}),
        log_dir=run_dir / "frozen",
        api_key=api_key,
    )
    return frozen.launch(model_path, 0), frozen


def _quiet_libraries() -> None:
    """Our own progress bar is the one users watch; silence per-save/load bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    *,
    max_steps: int | None = None,
    progress: bool = True,
    cache_dir: str | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_checkpoint: Callable[[int, str], None] | None = None,
    resume: bool = False,
    stop=None,
) -> dict:
    """Run one experiment; return its summary (also written to ``run_dir/summary.json``).

    ``on_step(row)`` is called after every training step with that step's metrics row;
    ``on_checkpoint(version, url)`` after every published checkpoint (version 0 included).
    Orchestrators (the Prefect flows) hook progress reports and events in here.

    ``resume``: continue from the latest checkpoint of this run's store (model, optimizer,
    data position, buffer, partial answers, metrics and ledger); a store with no version
    yet starts afresh, so a retry can always pass ``resume=True``.

    ``stop``: anything with ``is_set()`` (areal_core.interrupt.CtrlC, a threading.Event); once set,
    the step under way is the last: it is checkpointed, servers and Dask are stopped, and
    :class:`RunStopped` is raised (``resume=True`` continues from that step).
    """
    with contextlib.ExitStack() as stack:
        run = _open_run(cfg, Path(run_dir), max_steps, progress, resume)
        policy = _load_policy(run, cache_dir)
        training = _start_training(run, policy, stack, resume, on_checkpoint)
        with _start_pools(run, policy, training) as pools:
            before = training.before if training.before is not None else heldout_before(run, policy, pools)
            controller, publisher = _rollout(run, policy, training, pools)
            loop = _loop(run, policy, training, pools, controller, publisher, before, on_step, on_checkpoint, stop)
            with loop.lending.installed(policy.model) if loop.lending else contextlib.nullcontext():
                done = train_steps(loop, training.version, run.steps)
            if done.stopped:  # the checkpoint is written; leaving this block stops the servers, then Dask
                raise RunStopped(done.last_step, cfg.cost.budget_usd if done.budget_spent else None, done.servers_short)
            after, multi_agent = heldout_after(run, policy, pools, controller, before)
        return _summarize(run, policy, training, pools, controller, loop, done, before, after, multi_agent)


def _open_run(cfg: ExperimentConfig, run_dir: Path, max_steps: int | None, progress: bool, resume: bool) -> RunSetup:
    """Check the folder (a refused run writes nothing), set the trainer's threads and seed, write config.json."""
    t_start = time.perf_counter()
    cfg = with_run_folder(cfg, run_dir)  # (on Slurm: where the pool's servers announce themselves)
    check_run_folder(cfg, run_dir, resume)
    _quiet_libraries()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    trainer_threads = trainer_torch_threads(cfg, os.cpu_count() or 1)
    torch.set_num_threads(trainer_threads)
    require_repeatable()  # the trainer's thread count changes as it borrows cores: its MKL must not care
    config = cfg.model_dump(mode="json")
    write_json_atomic(str(run_dir / "config.json"), config)
    steps = max_steps or cfg.trainer.max_steps
    return RunSetup(cfg, run_dir, steps, trainer_threads, config, code_version(), progress, t_start)


def _load_policy(run: RunSetup, cache_dir: str | None) -> Policy:
    """The records, then the model (the tiny model with its supervised warm start, cached), as the
    trainer trains it, and the prompts; every budget is checked before the model is loaded."""
    cfg = run.cfg
    train_records, eval_records = load_records(cfg.data)
    curriculum = cfg.data.curriculum  # a record without its field fails here, before the warm start
    buckets = [bucket(r, curriculum.by) for r in train_records] if curriculum else None
    if cfg.model.name == "tiny":  # its char tokenizer: the prompts are checked before the warm start
        check_trajectory_budget(cfg, to_prompts(train_records, build_char_tokenizer()))
    dtype, dtype_why = model_dtype(cfg.model)
    log.info("computing in %s (%s)", dtype_name(dtype), dtype_why)
    warm = cfg.model.name == "tiny" and cfg.model.warm_start.steps
    run.phase(
        f"loading {cfg.model.name} in {dtype_name(dtype)} ({dtype_why})"
        + (" and its supervised warm start (cached after the first run)" if warm else "")
    )
    info: dict = {}
    model, tokenizer = load_base_model(
        cfg.model, train_records=train_records, seed=cfg.seed, cache_dir=cache_dir, progress=run.progress, info=info
    )
    if cfg.trainer.backend.kind == "torch":  # (the megatron trainer keeps its own copy, on the CPU here)
        model.to(resolve_device(cfg.model.device))
    model = trainable(model, cfg.trainer, cfg.seed)
    train_prompts = to_prompts(train_records, tokenizer, buckets=buckets)
    check_trajectory_budget(cfg, train_prompts)
    ma = cfg.multi_agent
    prompter = agent_prompter(ma.agents, train_records, tokenizer) if ma is not None else None
    check_agent_budget(cfg, train_prompts, prompter)
    return Policy(
        model,
        tokenizer,
        info,
        train_records,
        eval_records,
        train_prompts,
        to_prompts(eval_records[: cfg.eval.n_problems], tokenizer),
        AgentRouter.from_config(ma) if ma is not None else None,
        prompter,
    )


def _start_training(run: RunSetup, policy: Policy, stack, resume: bool, on_checkpoint) -> Training:
    """The trainer and the run's store and log; a fresh run publishes v0, a resumed one loads its latest checkpoint."""
    store = CheckpointStore.from_config(run.cfg.storage, str(run.dir))
    trainer = make_trainer(run.cfg, policy.model, run.steps, run.dir, stack)
    runlog = RunLog(run.dir)
    version, before, saved = _start_or_resume(
        run, policy.model, policy.tokenizer, trainer, store, runlog, policy.info, resume, on_checkpoint
    )
    return Training(trainer, store, runlog, version, before, saved)


@contextlib.contextmanager
def _start_pools(run: RunSetup, policy: Policy, training: Training):
    """The reward workers and the rollout servers (and a multi-agent run's frozen server), started
    together; the servers compute as the trainer's model does and load what it publishes."""
    cfg, store = run.cfg, training.store
    engine = cfg.rollout.engine_config(
        seed=cfg.seed, dtype=dtype_name(servers_model_dtype(cfg.model)[0]), device=cfg.model.device
    )
    api_key = new_key()  # the run's secret: the servers it starts require it (in their environment, not argv)
    backend = rollout_backend(cfg, engine=engine, run_dir=run.dir, api_key=api_key)  # (cluster.kind's)
    frozen_launch, frozen_backend = _frozen_launch(
        cfg, engine, run.dir, store.local_copy(0) if cfg.multi_agent else "", api_key
    )
    run.phase(f"starting the reward workers (Dask) and the rollout servers ({backend.name})")
    server_copy = store.loadable_url if backend.reads_store_urls else store.local_copy
    serve_from = published(policy.model).serving_version(training.version)
    start = server_copy(serve_from)
    rewards_up = reward_service(cfg, run.dir)  # (cluster.kind's: a local Dask cluster, or Slurm jobs)
    with entered_together(rewards_up, backend.launch(start, serve_from), frozen_launch) as (rewards, urls, frozen_urls):
        rewards.warm_up({r.task for r in (*policy.train_records, *policy.eval_records)}, training=True)
        yield Pools(rewards, list(urls), frozen_urls, backend, frozen_backend, engine, start, server_copy)


def _controller_settings(cfg: ExperimentConfig, model, servers_kv_tokens: int | None) -> ControllerSettings:
    r, t, curriculum = cfg.rollout, cfg.trainer, cfg.data.curriculum
    return ControllerSettings(
        batch_size=t.batch_size,
        eta=t.eta,
        n_samples=r.n_samples,
        sampling=r.sampling.to_sampling(),
        reward_correct=t.reward_correct,
        reward_wrong=t.reward_wrong,
        shuffle=cfg.data.shuffle,
        seed=cfg.seed,
        curriculum=curriculum.model_dump(exclude={"by"}) if curriculum else None,
        kv_budget_tokens=r.client_kv_budget_tokens(),
        # requests are clamped to what this leaves of their trajectory (multi-turn answers too)
        max_trajectory_tokens=trajectory_token_limit(
            cfg, getattr(model.config, "max_position_embeddings", None), servers_kv_tokens
        ),
        deterministic=r.deterministic,
        min_servers=r.min_servers,
    )


def _servers(cfg: ExperimentConfig, pools: Pools, store: CheckpointStore) -> tuple[Servers, Servers | None]:
    """The trainable policy's servers, and the frozen policy's (multi-agent runs that route agents to it)."""
    r, b = cfg.rollout, pools.backend
    trainable_pool = Servers(
        pools.urls,
        model_path=pools.start,
        make_client=b.client,
        restart=b.restart if b.restartable else None,
        request_timeout_s=r.request_timeout_s,
        discover=url_list(r.join_from) if r.join_from else None,
    )
    if not pools.frozen_urls:
        return trainable_pool, None
    frozen = Servers(
        pools.frozen_urls,
        model_path=store.local_copy(0),
        make_client=b.client,
        restart=pools.frozen_backend.restart,
        request_timeout_s=r.request_timeout_s,
    )
    return trainable_pool, frozen


def _rollout(run: RunSetup, policy: Policy, training: Training, pools: Pools):
    """The rollout controller (its buffer, settings and weight transport) and the publisher that
    stages versions for it; a resumed run's controller takes up its saved state."""
    cfg, model = run.cfg, policy.model
    transport = make_transport(
        weight_transport(cfg, pools.backend),
        str(run.dir),
        cfg.rollout.backend.kind in ADAPTER_BACKENDS,
        pools.engine.dtype,
    )
    servers, frozen = _servers(cfg, pools, training.store)
    controller = make_controller(
        servers,
        policy.train_prompts,
        policy.decode,
        pools.rewards,
        ReplayBuffer(ordered=cfg.rollout.deterministic),
        _controller_settings(cfg, model, servers_kv_budget(pools.urls, pools.backend.client)),
        transport,
        version=training.version,
        episode=make_episode(cfg.episode),
        encode=lambda text: policy.tokenizer.encode(text, add_special_tokens=False),
        agents=AgentSetup(policy.agents, policy.prompter, frozen) if policy.agents is not None else None,
    )
    if training.saved is not None:
        controller.restore(training.saved.state["controller"])
    publisher = WeightPublisher(transport, controller)
    pub = published(model)
    if pub.serves_a_base:  # the servers hold the base: restarts load it too, then what is staged before step 1
        base = pub.serving_version(training.version)
        controller.restart_from(lambda: pools.server_copy(base), base)
        publisher.stage(model, training.version)
    return controller, publisher


def _loop(run: RunSetup, policy, training, pools, controller, publisher, before, on_step, on_checkpoint, stop) -> Loop:
    """The training loop's parts: checkpoints that restart servers from what they load, the schedule,
    the cost ledger and, where it keeps runs repeatable, core lending."""
    cfg, model = run.cfg, policy.model
    pub = published(model)

    def written(result) -> None:  # a checkpoint is complete: evaluation and server restarts use it
        if on_checkpoint:
            on_checkpoint(result.version, result.url)
        serve_from = pub.serving_version(result.version)
        controller.restart_from(lambda: pools.server_copy(serve_from), serve_from)

    first = next(model.parameters())
    lent = lent_threads(cfg, run.trainer_threads, os.cpu_count() or 1, first.device, first.dtype)
    curriculum = cfg.data.curriculum
    meta = {
        "total_steps": run.steps,
        "trainer_threads": run.trainer_threads,
        "lent_threads": lent,
        "dtype": dtype_name(first.dtype),  # what a replay computes in, wherever it runs
        "numerics": cpu_kind(),
    }
    return Loop(
        name=cfg.name,
        model=model,
        trainer=training.trainer,
        buffer=controller.buffer,
        controller=controller,
        publisher=publisher,
        runlog=training.runlog,
        checkpoints=RunCheckpoints(
            training.store, cfg.storage, policy.tokenizer, training.version, written, cfg.trainer.max_steps
        ),
        config=run.config,
        code=run.code,
        before=before,
        batch_size=cfg.trainer.batch_size,
        eta=cfg.trainer.eta,
        warmup_steps=cfg.trainer.warmup_steps_for_throughput,
        agents=policy.agents,
        curriculum_by=curriculum.by if curriculum else None,
        on_step=on_step,
        stop=stop,
        progress=run.progress,
        schedule=ScheduleLog(run.dir, meta),
        costs=CostLedger(cfg.cost),
        lending=(
            CoreLending(
                controller.generating,
                run.trainer_threads,
                lent,
                cfg.trainer.lend_min_idle_share,
                held=controller.held_at_gate,
            )
            if lent
            else None
        ),
    )


def _summarize(run, policy, training, pools, controller, loop, done, before, after, multi_agent) -> dict:
    """summary.json and costs.parquet, once the servers and Dask are stopped."""
    summary = build_summary(
        run.cfg,
        steps=run.steps,
        loop=done,
        first_step=training.version + 1,
        runlog=training.runlog,
        before=before,
        after=after,
        model=policy.model,
        rollout_dtype=pools.engine.dtype,
        trainer_threads=run.trainer_threads,
        resumed_from=training.saved.version if training.saved is not None else None,
        model_info=policy.info,
        code=run.code,
        controller=controller,
        rewards=pools.rewards,
        store=training.store,
        checkpoints=loop.checkpoints,
        t_start=run.t_start,
    )
    if multi_agent is not None:
        summary["multi_agent"] = multi_agent
    write_json_atomic(str(run.dir / "summary.json"), summary)
    write_costs(training.runlog.metrics, run.dir / "costs.parquet")
    return summary


def _start_or_resume(
    run: RunSetup,
    model,
    tokenizer,
    trainer,
    store: CheckpointStore,
    runlog: RunLog,
    model_info: dict,
    resume: bool,
    on_checkpoint,
):
    """(version, accuracy before RL or None, the saved state or None): a fresh run publishes v0 (the
    base model, also for LoRA); a resumed one loads the latest checkpoint's weights, trainer state,
    metrics and ledger."""
    saved = run_state.load_latest(store, run.config, upgrade=upgraded_config) if resume else None
    if saved is None:
        if run.cfg.trainer.optim.continue_warm_start:  # the config check guarantees a warm start
            trainer.adopt_moments(load_optimizer_moments(model_info["warm_start"]["optimizer_moments"]))
        publish_state = {"n_submitted": 0, "n_groups": 0, "version": 0, "groups": []}
        with as_base(model):
            store.publish(
                0,
                model,
                tokenizer,
                meta={"step": 0},
                extra=run_state.encode(
                    0, run.config, publish_state, trainer.state_dict(), runlog.to_parquet_bytes(), None, run.code
                ),
            )
        if on_checkpoint:
            on_checkpoint(0, store.version_url(0))
        return 0, None, None
    restore_weights(store, model, saved.version)  # (LoRA: the base from v0, the adapters from the version)
    trainer.load_state_dict(saved.trainer)
    runlog.restore(saved.metrics, saved.ledger)
    if saved.state.get("code") != run.code:  # (None: written before checkpoints named their code)
        log.warning(
            "resuming from v%d, written by other code (%s; this is %s): the run's steps are not all of one code",
            saved.version,
            saved.state.get("code"),
            run.code,
        )
    if saved.version >= run.steps:
        log.warning("the run already has %d steps (asked for %d); nothing to train", saved.version, run.steps)
    return saved.version, saved.state["before"], saved
