from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_core.configbase import Section


class RewardConfig(Section):
    scheduler_address: str | None = None  # None: start a local Dask cluster (scheduler + workers, each a process)
    n_workers: int = Field(1, gt=0)  # local cluster workers (processes)
    threads_per_worker: int = Field(1, gt=0)
    # per answer, from when its worker starts grading it: one still being graded then is graded wrong
    # (reason "grading timed out", counted in the run summary's grading_timeouts). The graders' own
    # limits normally end a grading first (math: helper process killed after 20 s; code: the
    # sandbox's 10 s wall time); this one also covers a grader that hangs.
    timeout_s: float = Field(30.0, gt=0)
    # the reward of a code answer in training: all_pass (the AReaL paper's: reward_correct only if every
    # test passes, else reward_wrong) or fraction (reward_wrong + share of tests passed x (reward_correct
    # - reward_wrong); each failing test costs one more sandbox run). Accuracy and evaluation are all-pass.
    code_reward: Literal["all_pass", "fraction"] = "all_pass"
    # grade code in training even where the sandbox lacks a guarantee (sandbox.guarantees: no network, hidden
    # host files, confined writes, bounded disk, own user id, every process killed; e.g. the rlimits mode in a
    # container without CAP_SYS_ADMIN). False: training refuses to grade code there (sandbox.WeakSandboxError,
    # naming what is missing); True: it grades, and logs a warning naming it. A policy under RL learns to use
    # whatever the sandbox lets a program reach (the expected outputs in the checkout, the scheduler's port).
    allow_weak_sandbox: bool = False
