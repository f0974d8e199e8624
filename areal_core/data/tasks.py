"""The synthetic tasks, by the kind of ``data.synthetic``: the chain, code or arithmetic task."""

from __future__ import annotations

from areal_core.data.config import SyntheticArithTask, SyntheticCodeTask, SyntheticTask
from areal_core.data.synthetic import ChainTask
from areal_core.data.synthetic_arith import ArithTask
from areal_core.data.synthetic_code import FunctionTask


def synthetic_task(cfg: SyntheticTask | SyntheticCodeTask | SyntheticArithTask) -> ChainTask | FunctionTask | ArithTask:
    """The task that makes ``cfg``'s train and held-out records (``train_records()``, ``eval_records()``)."""
    if isinstance(cfg, SyntheticCodeTask):
        return FunctionTask(cfg)
    if isinstance(cfg, SyntheticArithTask):
        return ArithTask(cfg)
    return ChainTask(cfg)
