"""The trainer ``trainer.backend`` names, as a :class:`~areal_core.trainer.base.TrainEngine`."""

from __future__ import annotations

import contextlib

from areal_core.trainer.base import TrainEngine


def make_trainer(cfg, model, steps: int, run_dir, stack: contextlib.ExitStack) -> TrainEngine:
    """The trainer ``cfg.trainer.backend`` names (``cfg``: the experiment's config); what it starts
    (megatron's other ranks) is stopped when ``stack`` closes."""
    b, temperature = cfg.trainer.backend, cfg.rollout.sampling.temperature
    if b.kind == "torch":
        from areal_core.trainer.trainer import Trainer

        return Trainer(model, cfg.trainer, temperature, steps)
    from areal_core.trainer.megatron import parallel
    from areal_core.trainer.megatron.launch import local_ranks
    from areal_core.trainer.megatron.trainer import MegatronTrainer

    stack.enter_context(local_ranks(b.processes, b.tensor_parallel_size, run_dir))
    stack.callback(parallel.shutdown)
    trainer = MegatronTrainer(model, cfg.trainer, temperature, steps, tp_size=b.tensor_parallel_size, seed=cfg.seed)
    stack.callback(trainer.close)  # (runs first: releases the other ranks, then they are waited for)
    return trainer
