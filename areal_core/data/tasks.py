"""The synthetic tasks, by the kind of ``data.synthetic``: the chain task or the code task."""

from __future__ import annotations

from areal_core.data.config import SyntheticCodeTask, SyntheticTask
from areal_core.data.synthetic import ChainTask
from areal_core.data.synthetic_code import FunctionTask


def synthetic_task(cfg: SyntheticTask | SyntheticCodeTask) -> ChainTask | FunctionTask:
    """The task that makes ``cfg``'s train and held-out records (``train_records()``, ``eval_records()``)."""
    return FunctionTask(cfg) if isinstance(cfg, SyntheticCodeTask) else ChainTask(cfg)
