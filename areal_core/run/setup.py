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

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from areal_core.controller import AgentSetup, ControllerSettings, RolloutController, Servers
from areal_core.controller.agents import AgentRouter, agent_prompter
from areal_core.controller.buffer import ReplayBuffer
from areal_core.controller.elastic import url_list
from areal_core.data.datasets import bucket, load_records, to_prompts
from areal_core.data.prompting import decode_response
from areal_core.device import resolve_device
from areal_core.episodes import make_episode
from areal_core.eval.heldout import evaluate_prompts, heldout_sampling
from areal_core.experiment import ExperimentConfig, upgraded_config
from areal_core.models import build_char_tokenizer, load_base_model, load_optimizer_moments
from areal_core.models.loading import model_dtype
from areal_core.numerics import cpu_kind, require_repeatable
from areal_core.reward.service import RewardService
from areal_core.rollout.auth import new_key
from areal_core.rollout.backends import make_backend
from areal_core.rollout.weight_layout import dtype_name
from areal_core.rollout.weight_transport import ADAPTER_BACKENDS, make_transport
from areal_core.run.budget import check_agent_budget, check_trajectory_budget, trajectory_token_limit
from areal_core.run.checkpoints import RunCheckpoints, restore_weights
from areal_core.run.costs import CostLedger
from areal_core.run.costs import write_parquet as write_costs
from areal_core.run.folder import check_run_folder
from areal_core.run.loop import Loop, WeightPublisher, train_steps
from areal_core.run.metrics import RunLog
from areal_core.run.schedule import ScheduleLog
from areal_core.run.summary import build_summary
from areal_core.startup import entered_together, made_on_enter
from areal_core.storage import CheckpointStore, run_state, write_json_atomic
from areal_core.trainer import lora
from areal_core.trainer.backends import make_trainer
from areal_core.trainer.core_lending import CoreLending, lent_threads

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
    busy = r.torch_threads * (r.n_servers + frozen) if r.backend.kind == "embedded" else 0
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


def _weight_versions(urls: list[str], make_client) -> list[int]:
    """The weight version each server reports."""

    async def ask():
        clients = [make_client(u) for u in urls]
        try:
            return [(await c.info()).weight_version for c in clients]
        finally:
            for c in clients:
                await c.aclose()

    return asyncio.run(ask())


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
        return _run_experiment(
            cfg,
            Path(run_dir),
            stack,
            max_steps=max_steps,
            progress=progress,
            cache_dir=cache_dir,
            on_step=on_step,
            on_checkpoint=on_checkpoint,
            resume=resume,
            stop=stop,
        )


def _run_experiment(
    cfg: ExperimentConfig,
    run_dir: Path,
    stack: contextlib.ExitStack,
    *,
    max_steps,
    progress,
    cache_dir,
    on_step,
    on_checkpoint,
    resume,
    stop,
) -> dict:
    def phase(text: str) -> None:  # what the run is doing before (and after) its progress bar
        if progress:
            tqdm.write(f"[{cfg.name}] {text}")

    t_start = time.perf_counter()
    check_run_folder(cfg, run_dir, resume)  # a refused run writes nothing, config.json included
    _quiet_libraries()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    trainer_threads = trainer_torch_threads(cfg, os.cpu_count() or 1)
    torch.set_num_threads(trainer_threads)
    require_repeatable()  # the trainer's thread count changes as it borrows cores: its MKL must not care
    steps = max_steps or cfg.trainer.max_steps
    config = cfg.model_dump(mode="json")
    write_json_atomic(str(run_dir / "config.json"), config)

    # data and model (the tiny model gets its supervised warm start here, cached)
    train_records, eval_records = load_records(cfg.data)
    curriculum = cfg.data.curriculum  # a record without its field fails here, before the warm start
    buckets = [bucket(r, curriculum.by) for r in train_records] if curriculum else None
    if cfg.model.name == "tiny":  # its char tokenizer: the prompts are checked before the warm start
        check_trajectory_budget(cfg, to_prompts(train_records, build_char_tokenizer()))
    model_info: dict = {}
    dtype, dtype_why = model_dtype(cfg.model)
    log.info("computing in %s (%s)", dtype_name(dtype), dtype_why)
    phase(
        f"loading {cfg.model.name} in {dtype_name(dtype)} ({dtype_why})"
        + (
            " and its supervised warm start (cached after the first run)"
            if cfg.model.name == "tiny" and cfg.model.warm_start.steps
            else ""
        )
    )
    model, tokenizer = load_base_model(
        cfg.model, train_records=train_records, seed=cfg.seed, cache_dir=cache_dir, progress=progress, info=model_info
    )
    if cfg.trainer.backend.kind == "torch":  # (the megatron trainer keeps its own copy, on the CPU here)
        model.to(resolve_device(cfg.model.device))
    lora_cfg = cfg.trainer.lora  # only adapters train and travel; the base stays checkpoint v0 (trainer/lora.py)
    if lora_cfg is not None:
        lora.apply_lora(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, seed=cfg.seed)
    train_prompts = to_prompts(train_records, tokenizer, buckets=buckets)
    check_trajectory_budget(cfg, train_prompts)
    eval_prompts = to_prompts(eval_records[: cfg.eval.n_problems], tokenizer)
    ma = (
        cfg.multi_agent
    )  # several agents: each group is one agent's, routed by reward (areal_core/controller/agents.py)
    agents = AgentRouter.from_config(ma) if ma is not None else None
    prompter = agent_prompter(ma.agents, train_records, tokenizer) if ma is not None else None
    check_agent_budget(cfg, train_prompts, prompter)
    decode = lambda ids: decode_response(tokenizer, ids)  # noqa: E731

    store = CheckpointStore.from_config(cfg.storage, str(run_dir))
    trainer = make_trainer(cfg, model, steps, run_dir, stack)
    runlog = RunLog(run_dir)
    version, before, saved = _start_or_resume(
        cfg, config, model, tokenizer, trainer, store, runlog, model_info, resume, steps, on_checkpoint
    )

    # the servers compute as the trainer's model does
    engine = cfg.rollout.engine_config(seed=cfg.seed, dtype=dtype_name(model.dtype), device=cfg.model.device)
    api_key = new_key()  # the run's secret: the servers it starts require it (in their environment, not argv)
    backend = make_backend(cfg.rollout, engine=engine, log_dir=run_dir, api_key=api_key)
    frozen_launch, frozen_backend = _frozen_launch(cfg, engine, run_dir, store.local_copy(0) if ma else "", api_key)
    phase(f"starting the reward workers (Dask) and the rollout servers ({backend.name})")
    # LoRA: servers start (and restart) from the base, v0; the adapters are staged before the first step
    serve_from = 0 if lora_cfg is not None else version
    server_copy = store.loadable_url if backend.reads_store_urls else store.local_copy  # what servers load
    start = server_copy(serve_from)
    with entered_together(
        made_on_enter(RewardService, cfg.reward), backend.launch(start, serve_from), frozen_launch
    ) as (rewards, urls, frozen_urls):
        rewards.warm_up({r.task for r in (*train_records, *eval_records)}, training=True)

        serving = list(urls)  # the servers there are (after training: those left in an elastic pool)

        def heldout(prompts=eval_prompts) -> dict:
            sampling, timeout = heldout_sampling(cfg), cfg.rollout.request_timeout_s
            return evaluate_prompts(
                serving, prompts, decode, rewards, sampling, timeout_s=timeout, make_client=backend.client
            )

        def per_agent_accuracy() -> dict:  # held-out accuracy with each agent's prefix, on the trainable policy
            ask = agent_prompter(ma.agents, eval_records, tokenizer)
            return {
                a.id: heldout([dataclasses.replace(p, input_ids=ask(a.id, p)) for p in eval_prompts])["accuracy"]
                for a in ma.agents
            }

        if before is None:
            phase(f"held-out accuracy before RL, on {len(eval_prompts)} problems")
            before = heldout()
            if ma is not None and ma.eval_per_agent:
                before["per_agent"] = per_agent_accuracy()
        log.info("held-out accuracy before RL: %.3f", before["accuracy"])

        buffer = ReplayBuffer(ordered=cfg.rollout.deterministic)
        settings = ControllerSettings(
            batch_size=cfg.trainer.batch_size,
            eta=cfg.trainer.eta,
            n_samples=cfg.rollout.n_samples,
            sampling=cfg.rollout.sampling.to_sampling(),
            reward_correct=cfg.trainer.reward_correct,
            reward_wrong=cfg.trainer.reward_wrong,
            shuffle=cfg.data.shuffle,
            seed=cfg.seed,
            curriculum=curriculum.model_dump(exclude={"by"}) if curriculum else None,
            kv_budget_tokens=cfg.rollout.client_kv_budget_tokens(),
            # requests are clamped to what this leaves of their trajectory (multi-turn answers too)
            max_trajectory_tokens=trajectory_token_limit(cfg, getattr(model.config, "max_position_embeddings", None)),
            deterministic=cfg.rollout.deterministic,
            min_servers=cfg.rollout.min_servers,
        )
        transport = make_transport(
            cfg.rollout.transport(), str(run_dir), cfg.rollout.backend.kind in ADAPTER_BACKENDS, engine.dtype
        )
        servers = Servers(
            urls,
            model_path=start,
            make_client=backend.client,
            restart=backend.restart if backend.restartable else None,
            request_timeout_s=cfg.rollout.request_timeout_s,
            discover=url_list(cfg.rollout.join_from) if cfg.rollout.join_from else None,
        )
        frozen = (
            Servers(
                frozen_urls,
                model_path=store.local_copy(0),
                make_client=backend.client,
                restart=frozen_backend.restart,
                request_timeout_s=cfg.rollout.request_timeout_s,
            )
            if frozen_urls
            else None
        )
        controller = RolloutController(
            servers,
            train_prompts,
            decode,
            rewards,
            buffer,
            settings,
            transport,
            version=version,
            episode=make_episode(cfg.episode),
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            agents=AgentSetup(agents, prompter, frozen) if agents is not None else None,
        )
        if saved is not None:
            controller.restore(saved.state["controller"])
        publisher = WeightPublisher(transport, controller)
        if lora_cfg is not None:
            controller.restart_from(lambda: server_copy(0), 0)  # restarts: the base, then the adapters
            publisher.stage(model, version)

        def written(result) -> None:  # a checkpoint is complete: evaluation and server restarts use it
            if on_checkpoint:
                on_checkpoint(result.version, result.url)
            if lora_cfg is None:
                controller.restart_from(lambda: server_copy(result.version), result.version)

        first = next(model.parameters())
        lent = lent_threads(cfg, trainer_threads, os.cpu_count() or 1, first.device, first.dtype)
        loop = Loop(
            name=cfg.name,
            model=model,
            trainer=trainer,
            buffer=buffer,
            controller=controller,
            publisher=publisher,
            runlog=runlog,
            checkpoints=RunCheckpoints(store, cfg.storage, tokenizer, version, written, cfg.trainer.max_steps),
            config=config,
            before=before,
            batch_size=cfg.trainer.batch_size,
            eta=cfg.trainer.eta,
            warmup_steps=cfg.trainer.warmup_steps_for_throughput,
            agents=agents,
            curriculum_by=curriculum.by if curriculum else None,
            on_step=on_step,
            stop=stop,
            progress=progress,
            schedule=ScheduleLog(
                run_dir,
                {
                    "total_steps": steps,
                    "trainer_threads": trainer_threads,
                    "lent_threads": lent,
                    "dtype": dtype_name(first.dtype),  # what a replay computes in, wherever it runs
                    "numerics": cpu_kind(),
                },
            ),
            costs=CostLedger(cfg.cost),
            lending=CoreLending(controller.generating, trainer_threads, lent) if lent else None,
        )
        with loop.lending.installed(model) if loop.lending else contextlib.nullcontext():
            done = train_steps(loop, version, steps)
        if done.stopped:  # the checkpoint is written; leaving this block stops the servers, then Dask
            raise RunStopped(done.last_step, cfg.cost.budget_usd if done.budget_spent else None, done.servers_short)
        phase(f"held-out accuracy after RL, on {len(eval_prompts)} problems")
        serving[:] = controller.live_urls()
        after = heldout()
        multi_agent = None
        if agents is not None:
            multi_agent = {
                **agents.summary(),
                "frozen_answers": controller.frozen_generated,
                # what the frozen server reports now: its version never moved
                "frozen_server_versions": _weight_versions(frozen_urls, backend.client),
            }
            if ma.eval_per_agent:
                phase(f"held-out accuracy after RL with each agent's prefix, on {len(eval_prompts)} problems")
                multi_agent["per_agent_eval"] = {
                    a: {"before": before.get("per_agent", {}).get(a), "after": acc}
                    for a, acc in per_agent_accuracy().items()
                }

    summary = build_summary(
        cfg,
        steps=steps,
        loop=done,
        first_step=version + 1,
        runlog=runlog,
        before=before,
        after=after,
        model=model,
        trainer_threads=trainer_threads,
        resumed_from=saved.version if saved is not None else None,
        model_info=model_info,
        controller=controller,
        rewards=rewards,
        store=store,
        checkpoints=loop.checkpoints,
        t_start=t_start,
    )
    if multi_agent is not None:
        summary["multi_agent"] = multi_agent
    write_json_atomic(str(run_dir / "summary.json"), summary)
    write_costs(runlog.metrics, run_dir / "costs.parquet")
    return summary


def _start_or_resume(
    cfg: ExperimentConfig,
    config: dict,
    model,
    tokenizer,
    trainer,
    store: CheckpointStore,
    runlog: RunLog,
    model_info: dict,
    resume: bool,
    steps: int,
    on_checkpoint,
):
    """(version, accuracy before RL or None, the saved state or None): a fresh run publishes v0 (the
    base model, also for LoRA); a resumed one loads the latest checkpoint's weights, trainer state,
    metrics and ledger."""
    saved = run_state.load_latest(store, config, upgrade=upgraded_config) if resume else None
    if saved is None:
        if cfg.trainer.optim.continue_warm_start:  # the config check guarantees a warm start
            trainer.adopt_moments(load_optimizer_moments(model_info["warm_start"]["optimizer_moments"]))
        publish_state = {"n_submitted": 0, "n_groups": 0, "version": 0, "groups": []}
        with lora.without_adapters(model):
            store.publish(
                0,
                model,
                tokenizer,
                meta={"step": 0},
                extra=run_state.encode(0, config, publish_state, trainer.state_dict(), runlog.to_parquet_bytes(), None),
            )
        if on_checkpoint:
            on_checkpoint(0, store.version_url(0))
        return 0, None, None
    restore_weights(store, model, saved.version)  # (LoRA: the base from v0, the adapters from the version)
    trainer.load_state_dict(saved.trainer)
    runlog.restore(saved.metrics, saved.ledger)
    if saved.version >= steps:
        log.warning("the run already has %d steps (asked for %d); nothing to train", saved.version, steps)
    return saved.version, saved.state["before"], saved
