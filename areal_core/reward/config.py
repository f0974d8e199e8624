from __future__ import annotations

from pydantic import Field

from areal_core.configbase import Section


class RewardConfig(Section):
    scheduler_address: str | None = None  # None: start a Dask LocalCluster
    n_workers: int = Field(1, gt=0)  # LocalCluster workers (processes)
    threads_per_worker: int = Field(1, gt=0)
    timeout_s: float = Field(30.0, gt=0)  # per grading task
