"""One experiment, top to bottom: warm start, serve, generate asynchronously, train, publish.

    records -> model (+ supervised warm start) -> publish v0 -> rollout servers + Dask
    -> held-out accuracy before -> controller (background) ->
    for each step: take B trajectories (staleness-bounded) -> PPO step -> publish v+1
                   -> servers load v+1 (interrupting in-flight generation)
    -> held-out accuracy after -> metrics.parquet, ledger.parquet, summary.json
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from areal_core.buffer import ReplayBuffer
from areal_core.controller import ControllerSettings, RolloutController
from areal_core.data.prompting import decode_response
from areal_core.datasets import load_records, to_prompts
from areal_core.eval.heldout import evaluate_prompts
from areal_core.experiment import ExperimentConfig
from areal_core.metrics import RunLog, check_ledger, ledger_rows
from areal_core.models import load_base_model
from areal_core.reward.service import RewardService
from areal_core.rollout.client import RolloutPool
from areal_core.rollout.launcher import start_server
from areal_core.storage import CheckpointStore, write_json_atomic
from areal_core.trainer.trainer import Trainer

log = logging.getLogger(__name__)


@contextlib.contextmanager
def rollout_servers(cfg: ExperimentConfig, model_path: str, run_dir: Path):
    """Embedded servers started here (and stopped by PID), or the configured external ones."""
    r = cfg.rollout
    with contextlib.ExitStack() as stack:
        if r.backend == "embedded":
            urls = []
            for k in range(r.n_servers):
                srv = stack.enter_context(start_server(
                    model_path, max_running=r.max_running, interruptible=r.interruptible,
                    torch_threads=r.torch_threads, weight_version=0,
                    log_path=str(run_dir / f"rollout_server_{k}.log"),
                ))
                urls.append(srv.url)
        else:
            urls = list(r.urls)
        yield urls


async def _push_weights(urls: list[str], path: str, version: int) -> None:
    pool = RolloutPool(urls)
    try:
        await pool.update_weights(path, version)
    finally:
        await pool.aclose()


def _percentiles(xs: list[int]) -> dict:
    t = torch.tensor(xs, dtype=torch.float32)
    return {"p50": float(t.quantile(0.5)), "p90": float(t.quantile(0.9)), "max": int(t.max())}


def _quiet_libraries() -> None:
    """Our own progress bar is the one users watch; silence per-save/load bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_experiment(cfg: ExperimentConfig, run_dir: str | Path, *, max_steps: int | None = None,
                   progress: bool = True, cache_dir: str | None = None,
                   on_step: Callable[[dict], None] | None = None,
                   on_checkpoint: Callable[[int, str], None] | None = None) -> dict:
    """Run one experiment; return its summary (also written to ``run_dir/summary.json``).

    ``on_step(row)`` is called after every training step with that step's metrics row;
    ``on_checkpoint(version, url)`` after every published checkpoint (version 0 included).
    Orchestrators (the Prefect flows) hook progress reports and events in here.
    """
    t_start = time.perf_counter()
    _quiet_libraries()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    steps = max_steps or cfg.trainer.max_steps
    B, eta = cfg.trainer.batch_size, cfg.trainer.eta
    write_json_atomic(str(run_dir / "config.json"), cfg.model_dump(mode="json"))

    # data and model (the tiny model gets its supervised warm start here, cached)
    train_records, eval_records = load_records(cfg.data)
    model, tokenizer = load_base_model(cfg.model, train_records=train_records, seed=cfg.seed,
                                       cache_dir=cache_dir, progress=progress)
    train_prompts = to_prompts(train_records, tokenizer)
    eval_prompts = to_prompts(eval_records[: cfg.eval.n_problems], tokenizer)
    decode = lambda ids: decode_response(tokenizer, ids)  # noqa: E731

    store = CheckpointStore.from_config(cfg.storage, str(run_dir))
    store.publish(0, model, tokenizer, meta={"step": 0})
    if on_checkpoint:
        on_checkpoint(0, store.version_url(0))
    max_new = cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens

    with RewardService(cfg.reward) as rewards, rollout_servers(cfg, store.local_copy(0), run_dir) as urls:
        if cfg.rollout.backend == "external":  # external servers must start from v0 too
            asyncio.run(_push_weights(urls, store.local_copy(0), 0))
        before = evaluate_prompts(urls, eval_prompts, decode, rewards, temperature=cfg.eval.temperature,
                                  max_new_tokens=max_new)
        log.info("held-out accuracy before RL: %.3f", before["accuracy"])

        buffer = ReplayBuffer()
        settings = ControllerSettings(
            batch_size=B, eta=eta, n_samples=cfg.rollout.n_samples,
            sampling=cfg.rollout.sampling.model_dump(), reward_correct=cfg.trainer.reward_correct,
            reward_wrong=cfg.trainer.reward_wrong, shuffle=cfg.data.shuffle, seed=cfg.seed,
        )
        controller = RolloutController(urls, train_prompts, decode, rewards, buffer, settings,
                                       request_timeout_s=cfg.rollout.request_timeout_s)
        trainer = Trainer(model, cfg.trainer, cfg.rollout.sampling.temperature, steps)
        runlog = RunLog(run_dir)
        version = 0
        rl_start = time.perf_counter()
        warm_t, warm_tokens, tokens_total = None, 0, 0
        trained_lengths: list[int] = []
        bar = tqdm(total=steps, desc=f"RL {cfg.name}", unit="step", disable=not progress)
        controller.start()
        try:
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                gen_before = controller.generated_tokens
                batch = buffer.take(B, version, eta)
                t_wait = time.perf_counter() - t0
                stats = trainer.step(batch, version)
                version += 1
                t1 = time.perf_counter()
                store.publish(version, model, tokenizer, meta={"step": step})
                if on_checkpoint:
                    on_checkpoint(version, store.version_url(version))
                controller.update_weights(store.local_copy(version), version)
                if cfg.storage.keep_last:
                    store.prune(cfg.storage.keep_last)
                now = time.perf_counter()
                tokens_total += stats["tokens_trained"]
                trained_lengths.extend(len(t.output_ids) for t in batch)
                if step == cfg.trainer.warmup_steps_for_throughput:
                    warm_t, warm_tokens = now, tokens_total
                row = {
                    "step": step, "version": version, **stats,
                    "wait_time_s": t_wait, "publish_time_s": now - t1, "step_time_s": now - t0,
                    "generated_tokens": controller.generated_tokens - gen_before,
                    "train_tokens_per_s": stats["tokens_trained"] / (now - t0),
                    "elapsed_s": now - rl_start,
                }
                runlog.log_step(row, ledger_rows(batch, step, version - 1))
                if on_step:
                    on_step({**row, "total_steps": steps})
                bar.update(1)
                bar.set_postfix(reward=f"{stats['reward']:.2f}", acc=f"{stats['accuracy']:.2f}",
                                stale=stats["staleness_max"], len=int(stats["answer_len_mean"]))
        finally:
            bar.close()
            controller.stop()
        rl_end = time.perf_counter()
        after = evaluate_prompts(urls, eval_prompts, decode, rewards, temperature=cfg.eval.temperature,
                                 max_new_tokens=max_new)

    if warm_t is not None and steps > cfg.trainer.warmup_steps_for_throughput:
        eff = (tokens_total - warm_tokens) / (rl_end - warm_t)
    else:
        eff = tokens_total / (rl_end - rl_start)
    ledger = check_ledger(runlog.ledger_frame(), steps, B)
    m = runlog.metrics
    summary = {
        "name": cfg.name,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "n_eval_problems": before["n"],
        "steps": steps,
        "final_version": version,
        "eta": eta,
        "objective": cfg.trainer.objective,
        "interruptible": cfg.rollout.interruptible,
        "microbatching": cfg.trainer.microbatching,
        "max_staleness_observed": max(r["staleness_max"] for r in m),
        "effective_train_tokens_per_s": eff,
        "tokens_trained": tokens_total,
        "rl_time_s": rl_end - rl_start,
        "wall_time_s": time.perf_counter() - t_start,
        "answer_length_before": _percentiles(before["lengths"]),
        "answer_length_after": _percentiles(after["lengths"]),
        "trained_answer_length": _percentiles(trained_lengths),
        "ledger_check": ledger,
        "checkpoints": store.url,
    }
    write_json_atomic(str(run_dir / "summary.json"), summary)
    return summary
