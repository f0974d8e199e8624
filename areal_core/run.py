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
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from areal_core.agents import FROZEN, AgentRouter, agent_prompter
from areal_core.buffer import ReplayBuffer
from areal_core.controller import ControllerSettings, RolloutController
from areal_core.data.prompting import decode_response
from areal_core.datasets import bucket, load_records, to_prompts
from areal_core.device import resolve_device
from areal_core.episodes import make_episode
from areal_core.eval.heldout import evaluate_prompts
from areal_core.experiment import ExperimentConfig
from areal_core.metrics import RunLog, check_ledger, ledger_rows
from areal_core.models import build_char_tokenizer, load_base_model, load_optimizer_moments
from areal_core.models.loading import model_dtype
from areal_core.prompt_sampling import describe_mix
from areal_core.reward.service import RewardService
from areal_core.rollout.auth import new_key
from areal_core.rollout.backends import make_backend
from areal_core.rollout.weight_layout import dtype_name
from areal_core.rollout.weight_transport import ADAPTER_BACKENDS, make_transport
from areal_core.run_checkpoints import RunCheckpoints, restore_weights
from areal_core.run_folder import check_run_folder
from areal_core.storage import CheckpointStore, run_state, write_json_atomic
from areal_core.trainer import lora
from areal_core.trainer.trainer import Trainer
from areal_core.trajectory_budget import check_agent_budget, check_trajectory_budget, trajectory_token_limit

log = logging.getLogger(__name__)

METRICS_FLUSH_S = 5.0  # metrics.parquet / ledger.parquet are rewritten at most this often during a run (and at its end)


class RunStopped(Exception):
    """The run was asked to stop (``stop``, e.g. Ctrl-C) and did: ``step`` was trained and checkpointed."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}")
        self.step = step


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
    from areal_core.rollout.launcher import EmbeddedBackend, server_seed

    (run_dir / "frozen").mkdir(parents=True, exist_ok=True)
    frozen = EmbeddedBackend(1, engine.model_copy(update={"seed": server_seed(cfg.seed, 1_000_003)}),
                             log_dir=run_dir / "frozen", api_key=api_key)
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


def _percentiles(xs: list[int]) -> dict:
    t = torch.tensor(xs, dtype=torch.float32)
    return {"p50": float(t.quantile(0.5)), "p90": float(t.quantile(0.9)), "max": int(t.max())}


def _quiet_libraries() -> None:
    """Our own progress bar is the one users watch; silence per-save/load bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def make_trainer(cfg: ExperimentConfig, model, steps: int, run_dir: Path, stack: contextlib.ExitStack):
    """The trainer ``trainer.backend`` names; what it starts (megatron's other ranks) is stopped
    when ``stack`` closes."""
    b, temperature = cfg.trainer.backend, cfg.rollout.sampling.temperature
    if b.kind == "torch":
        return Trainer(model, cfg.trainer, temperature, steps)
    from areal_core.trainer.megatron import parallel
    from areal_core.trainer.megatron.launch import local_ranks
    from areal_core.trainer.megatron.trainer import MegatronTrainer

    stack.enter_context(local_ranks(b.processes, b.tensor_parallel_size, run_dir))
    stack.callback(parallel.shutdown)
    trainer = MegatronTrainer(model, cfg.trainer, temperature, steps, tp_size=b.tensor_parallel_size, seed=cfg.seed)
    stack.callback(trainer.close)  # (runs first: releases the other ranks, then they are waited for)
    return trainer


def run_experiment(cfg: ExperimentConfig, run_dir: str | Path, *, max_steps: int | None = None,
                   progress: bool = True, cache_dir: str | None = None,
                   on_step: Callable[[dict], None] | None = None,
                   on_checkpoint: Callable[[int, str], None] | None = None,
                   resume: bool = False, stop=None) -> dict:
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
        return _run_experiment(cfg, Path(run_dir), stack, max_steps=max_steps, progress=progress,
                               cache_dir=cache_dir, on_step=on_step, on_checkpoint=on_checkpoint, resume=resume,
                               stop=stop)


def _writes_to_terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def logs_above_the_bar(enabled: bool):
    """While a progress bar is shown, every logger that writes to the terminal (ours, Prefect's,
    Dask's) writes through tqdm, on its own line above the bar, instead of gluing its lines to it."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    with logging_redirect_tqdm([lg for lg in loggers if any(map(_writes_to_terminal, lg.handlers))], tqdm_class=tqdm):
        yield


def _run_experiment(cfg: ExperimentConfig, run_dir: Path, stack: contextlib.ExitStack, *, max_steps, progress,
                    cache_dir, on_step, on_checkpoint, resume, stop) -> dict:
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
    steps = max_steps or cfg.trainer.max_steps
    B, eta = cfg.trainer.batch_size, cfg.trainer.eta
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
    phase(f"loading {cfg.model.name} in {dtype_name(dtype)} ({dtype_why})"
          + (" and its supervised warm start (cached after the first run)"
             if cfg.model.name == "tiny" and cfg.model.warm_start.steps else ""))
    model, tokenizer = load_base_model(cfg.model, train_records=train_records, seed=cfg.seed,
                                       cache_dir=cache_dir, progress=progress, info=model_info)
    if cfg.trainer.backend.kind == "torch":  # (the megatron trainer keeps its own copy, on the CPU here)
        model.to(resolve_device(cfg.model.device))
    lora_cfg = cfg.trainer.lora  # only adapters train and travel; the base stays checkpoint v0 (trainer/lora.py)
    if lora_cfg is not None:
        lora.apply_lora(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, seed=cfg.seed)
    train_prompts = to_prompts(train_records, tokenizer, buckets=buckets)
    check_trajectory_budget(cfg, train_prompts)
    eval_prompts = to_prompts(eval_records[: cfg.eval.n_problems], tokenizer)
    ma = cfg.multi_agent  # several agents: each group is one agent's, routed by reward (areal_core/agents.py)
    agents = AgentRouter.from_config(ma) if ma is not None else None
    prompter = agent_prompter(ma.agents, train_records, tokenizer) if ma is not None else None
    check_agent_budget(cfg, train_prompts, prompter)
    decode = lambda ids: decode_response(tokenizer, ids)  # noqa: E731

    store = CheckpointStore.from_config(cfg.storage, str(run_dir))
    trainer = make_trainer(cfg, model, steps, run_dir, stack)
    runlog = RunLog(run_dir)
    saved = run_state.load_latest(store, config) if resume else None
    if saved is None:
        version, before = 0, None
        if cfg.trainer.optim.continue_warm_start:  # the config check guarantees a warm start
            trainer.adopt_moments(load_optimizer_moments(model_info["warm_start"]["optimizer_moments"]))
        publish_state = {"n_submitted": 0, "n_groups": 0, "version": 0, "groups": []}
        with lora.without_adapters(model):  # v0: the base model, also for a LoRA run
            store.publish(0, model, tokenizer, meta={"step": 0}, extra=run_state.encode(
                0, config, publish_state, trainer.state_dict(), runlog.to_parquet_bytes(), None))
        if on_checkpoint:
            on_checkpoint(0, store.version_url(0))
    else:
        version, before = saved.version, saved.state["before"]
        restore_weights(store, model, version)  # (LoRA: the base from v0, the adapters from the version)
        trainer.load_state_dict(saved.trainer)
        runlog.restore(saved.metrics, saved.ledger)
        if version >= steps:
            log.warning("the run already has %d steps (asked for %d); nothing to train", version, steps)
    max_new = cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens

    # the servers compute as the trainer's model does
    engine = cfg.rollout.engine_config(seed=cfg.seed, dtype=dtype_name(model.dtype), device=cfg.model.device)
    api_key = new_key()  # the run's secret: the servers it starts require it (in their environment, not argv)
    backend = make_backend(cfg.rollout, engine=engine, log_dir=run_dir, api_key=api_key)
    frozen_launch, frozen_backend = _frozen_launch(cfg, engine, run_dir, store.local_copy(0) if ma else "", api_key)
    phase(f"starting the reward workers (Dask) and the rollout servers ({backend.name})")
    # LoRA: servers start (and restart) from the base, v0; start() pushes the adapters staged below
    serve_from = 0 if lora_cfg is not None else version
    with RewardService(cfg.reward) as rewards, \
            backend.launch(store.local_copy(serve_from), serve_from) as urls, frozen_launch as frozen_urls:
        rewards.warm_up({r.task for r in (*train_records, *eval_records)}, training=True)

        def per_agent_accuracy() -> dict:  # held-out accuracy with each agent's prefix, on the trainable policy
            ask = agent_prompter(ma.agents, eval_records, tokenizer)
            return {a.id: evaluate_prompts(urls, [dataclasses.replace(p, input_ids=ask(a.id, p)) for p in eval_prompts],
                                           decode, rewards, make_client=backend.client,
                                           temperature=cfg.eval.temperature, max_new_tokens=max_new)["accuracy"]
                    for a in ma.agents}

        if before is None:
            phase(f"held-out accuracy before RL, on {len(eval_prompts)} problems")
            before = evaluate_prompts(urls, eval_prompts, decode, rewards, make_client=backend.client,
                                      temperature=cfg.eval.temperature,
                                      max_new_tokens=max_new)
            if ma is not None and ma.eval_per_agent:
                before["per_agent"] = per_agent_accuracy()
        log.info("held-out accuracy before RL: %.3f", before["accuracy"])

        buffer = ReplayBuffer()
        settings = ControllerSettings(
            batch_size=B, eta=eta, n_samples=cfg.rollout.n_samples,
            sampling=cfg.rollout.sampling.model_dump(), reward_correct=cfg.trainer.reward_correct,
            reward_wrong=cfg.trainer.reward_wrong, shuffle=cfg.data.shuffle, seed=cfg.seed,
            curriculum=curriculum.model_dump(exclude={"by"}) if curriculum else None,
            kv_budget_tokens=cfg.rollout.client_kv_budget_tokens(),
            # requests are clamped to what this leaves of their trajectory (multi-turn answers too)
            max_trajectory_tokens=trajectory_token_limit(cfg, getattr(model.config, "max_position_embeddings", None)),
        )
        transport = make_transport(cfg.rollout.transport(), str(run_dir),
                                   adapters=cfg.rollout.backend.kind in ADAPTER_BACKENDS)
        controller = RolloutController(urls, train_prompts, decode, rewards, buffer, settings, transport,
                                       version=version, request_timeout_s=cfg.rollout.request_timeout_s,
                                       model_path=store.local_copy(serve_from),
                                       restart_server=backend.restart if backend.restartable else None,
                                       make_client=backend.client, episode=make_episode(cfg.episode),
                                       encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                                       agents=agents, agent_prompt=prompter, frozen_urls=frozen_urls,
                                       frozen_model_path=store.local_copy(0) if frozen_urls else "",
                                       restart_frozen=frozen_backend.restart if frozen_backend else None)
        if saved is not None:
            controller.restore(saved.state["controller"])
        if lora_cfg is not None:
            controller.restart_from(lambda: store.local_copy(0), 0)  # restarts: the base, then the adapters
            transport.stage(model, version)
        first_step = version + 1

        def written(result) -> None:  # a checkpoint is complete: evaluation and server restarts use it
            if on_checkpoint:
                on_checkpoint(result.version, result.url)
            if lora_cfg is None:
                controller.restart_from(lambda: store.local_copy(result.version), result.version)

        checkpoints = RunCheckpoints(store, cfg.storage, tokenizer, last_step=version, on_written=written)
        rl_start = time.perf_counter()
        warm_t, warm_tokens, tokens_total = None, 0, 0
        bar = tqdm(total=steps, initial=min(version, steps), desc=f"RL {cfg.name}", unit="step", disable=not progress)
        with checkpoints, logs_above_the_bar(progress):
            try:
                controller.start()
                syncing = None  # the push of the last version, running while the trainer works
                stopping = False
                for step in range(first_step, steps + 1):
                    t0 = time.perf_counter()
                    gen_before = controller.generated_tokens
                    batch = buffer.take(B, version, eta)  # waits only for what the staleness bound needs
                    t_wait = time.perf_counter() - t0
                    stopping = stop is not None and stop.is_set()  # this step is the last, checkpointed
                    checkpointing = checkpoints.due(step, final=step == steps) or stopping
                    if checkpointing:
                        controller.refresh_partials()  # for the resume state, read while we train
                    if any(t.route == FROZEN for t in batch):  # the buffer never holds them: a bug if so
                        raise RuntimeError("a frozen-policy trajectory reached the trainer")
                    stats = trainer.step(batch, version)
                    # the proximal policy of this step is the weights it started from (none for naive PPO)
                    prox_version = version if stats.get("prox_logp_path") != "none" else None
                    for t in batch:
                        t.prox_version = prox_version
                    version += 1
                    t1 = time.perf_counter()
                    if syncing is not None:
                        syncing.result()  # the transport's buffer is free once the previous push is done
                    t_sync = time.perf_counter() - t1
                    transport.stage(model, version)
                    syncing = controller.update_weights(version)  # servers get it while we go on
                    t2 = time.perf_counter()
                    mix = controller.curriculum_mix
                    row = {
                        "step": step, "version": version, **stats, "wait_time_s": t_wait,
                        # of that wait, the part for grades alone (single-turn episodes only: NaN otherwise)
                        "reward_wait_s": buffer.last_reward_wait_s if controller.measures_reward_wait else math.nan,
                        "generated_tokens": controller.generated_tokens - gen_before,
                        **{f"pass_rate_{b}": p for b, p in controller.pass_rates.items()},  # with a curriculum
                        **{f"mix_{b}": p for b, p in mix.items()},
                        # multi-turn episodes: answers' turns, and text the environment added (not trained)
                        "turns_mean": sum(t.reward_info.get("turns", 1) for t in batch) / len(batch),
                        "environment_tokens": sum(len(t.output_mask) - sum(t.output_mask) for t in batch),
                        # multi-agent runs: per agent R(a), rewards since the last row, route; trained here
                        **controller.agent_metrics(),
                        **({f"agent_{a}_trained": sum(t.agent_id == a for t in batch) for a in agents.ids}
                           if agents is not None else {}),
                    }
                    runlog.log_step(row, ledger_rows(batch, step, version - 1, prox_version), flush=False)
                    t_ckpt_wait = 0.0
                    if checkpointing:  # weights, optimizer and every untrained answer, as of this step
                        t_ckpt_wait = checkpoints.write(step, model, run_state.encode(
                            step, config, controller.snapshot(), trainer.state_dict(), runlog.to_parquet_bytes(),
                            before), final=step == steps)
                    else:
                        checkpoints.poll()
                    now = time.perf_counter()
                    row.update({"weight_sync_wait_s": t_sync, "weight_stage_s": t2 - t1 - t_sync,
                                # bytes each server receives for this version; the previous version's push time
                                "weight_update_bytes": transport.staged_bytes,
                                "weight_push_s": math.nan if transport.last_push_s is None else transport.last_push_s,
                                "checkpoint": checkpointing, "checkpoint_wait_s": t_ckpt_wait,
                                "publish_time_s": now - t1, "step_time_s": now - t0,
                                "train_tokens_per_s": stats["tokens_trained"] / (now - t0),
                                "elapsed_s": now - rl_start})
                    runlog.flush(min_interval_s=METRICS_FLUSH_S)
                    tokens_total += stats["tokens_trained"]
                    if step == first_step - 1 + cfg.trainer.warmup_steps_for_throughput:
                        warm_t, warm_tokens = now, tokens_total
                    if on_step:
                        on_step({**row, "total_steps": steps})
                    bar.update(1)
                    # with a curriculum the batch's accuracy is on the prompts the curriculum drew
                    # (it moves to harder ones as the policy improves): labelled so, with the mix
                    acc = {"acc": f"{stats['accuracy']:.2f}"} if not mix else {
                        "acc_on_mix": f"{stats['accuracy']:.2f}", "mix": describe_mix(mix, cfg.data.curriculum.by, 2)}
                    bar.set_postfix(reward=f"{stats['reward']:.2f}", **acc, stale=stats["staleness_max"],
                                    len=int(stats["answer_len_mean"]))
                    if stopping:
                        break
                runlog.flush()
                if syncing is not None:
                    syncing.result()  # the servers hold the final weights before the evaluation
            finally:
                bar.close()
                controller.stop()
                transport.close()
        if stopping:  # the checkpoint is written; leaving this block stops the servers, then Dask
            raise RunStopped(step)
        rl_end = time.perf_counter()
        phase(f"held-out accuracy after RL, on {len(eval_prompts)} problems")
        after = evaluate_prompts(urls, eval_prompts, decode, rewards, make_client=backend.client,
                                     temperature=cfg.eval.temperature,
                                 max_new_tokens=max_new)
        multi_agent = None
        if agents is not None:
            multi_agent = {**agents.summary(), "frozen_answers": controller.frozen_generated,
                           # what the frozen server reports now: its version never moved
                           "frozen_server_versions": _weight_versions(frozen_urls, backend.client)}
            if ma.eval_per_agent:
                phase(f"held-out accuracy after RL with each agent's prefix, on {len(eval_prompts)} problems")
                multi_agent["per_agent_eval"] = {a: {"before": before.get("per_agent", {}).get(a), "after": acc}
                                                 for a, acc in per_agent_accuracy().items()}

    # throughput of this process's steps (after its own warm-up), so a resumed run is not
    # credited with the time before the stop
    warm_step = first_step - 1 + cfg.trainer.warmup_steps_for_throughput
    if warm_t is not None and steps > warm_step:
        eff, throughput_steps = (tokens_total - warm_tokens) / (rl_end - warm_t), steps - warm_step
    else:  # too short to leave out a warm-up
        eff, throughput_steps = tokens_total / max(rl_end - rl_start, 1e-9), steps - first_step + 1
    frame = runlog.ledger_frame()
    ledger = check_ledger(frame, steps, B, eta)  # exactly once, and no trained token staler than eta
    trained_lengths = frame["n_tokens"].astype(int).tolist()
    m = runlog.metrics
    # the trainer's wait for grades alone, over this process's steps (NaN: multi-turn, not measured)
    reward_wait = sum(r["reward_wait_s"] for r in m if r["step"] >= first_step and "reward_wait_s" in r)
    summary = {
        "name": cfg.name,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "n_eval_problems": before["n"],
        "steps": steps,
        "final_version": version,
        "eta": eta,
        "objective": cfg.trainer.objective,
        "trainer_backend": cfg.trainer.backend.kind,
        "dtype": dtype_name(model.dtype),
        "weight_update": cfg.rollout.weight_update,
        "trainer_torch_threads": trainer_threads,
        "weight_transport": cfg.rollout.transport().kind,
        "microbatching": cfg.trainer.microbatching,
        "max_staleness_observed": max(r["staleness_max"] for r in m),
        "effective_train_tokens_per_s": eff,
        "throughput_steps": throughput_steps,  # the steps that figure rests on
        "tokens_trained": int(sum(trained_lengths)),
        "resumed_from_step": saved.version if saved is not None else None,
        "warm_start": {k: model_info["warm_start"].get(k) for k in ("steps", "val_accuracy", "wall_s", "cached")}
        if "warm_start" in model_info else None,
        "rollout_resubmits": controller.resubmitted,
        "grading_resubmits": rewards.n_resubmitted,
        "grading_tasks": rewards.n_tasks,
        "grading_timeouts": rewards.n_timed_out,
        "rl_time_s": rl_end - rl_start,
        "reward_wait_s": reward_wait,
        "reward_wait_share": reward_wait / max(rl_end - rl_start, 1e-9),  # of the RL time
        "wall_time_s": time.perf_counter() - t_start,
        "answer_length_before": _percentiles(before["lengths"]),
        "answer_length_after": _percentiles(after["lengths"]),
        "trained_answer_length": _percentiles(trained_lengths),
        "ledger_check": ledger,
        "checkpoints": store.url,
        "checkpoint_writes": checkpoints.written,
        "checkpoint_bytes_per_step": sum(w["bytes"] for w in checkpoints.written) / max(1, steps - first_step + 1),
    }
    if multi_agent is not None:
        summary["multi_agent"] = multi_agent
    write_json_atomic(str(run_dir / "summary.json"), summary)
    return summary
