from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from areal_core.configbase import Section


class RewardConfig(Section):
    """How answers are graded: the Dask cluster the graders run on, their time limit, and code's reward."""

    # None: start a local Dask cluster (scheduler + workers, each a process, over TLS with certificates made
    # for the run); else an existing scheduler: tls://host:port (with the tls_* files below), or tcp:// (no
    # authentication: any process that reaches it can run code there; logged as a warning)
    scheduler_address: str | None = None
    # tls:// scheduler: the CA certificate (PEM) the cluster's certificates are signed by
    tls_ca_file: str | None = None
    tls_client_cert: str | None = None  # tls:// scheduler: this run's client certificate (PEM), signed by that CA
    tls_client_key: str | None = None  # tls:// scheduler: its private key (PEM; None: in tls_client_cert)
    n_workers: int = Field(1, gt=0)  # local cluster workers (processes)
    threads_per_worker: int = Field(1, gt=0)  # answers a local worker grades at once (Dask threads)
    # per answer, from when its worker starts grading it: one still being graded then is graded wrong
    # (reason "grading timed out", counted in the run summary's grading_timeouts). The graders' own
    # limits normally end a grading first (math: helper process killed after 20 s; code: the
    # sandbox's 10 s wall time); this one also covers a grader that hangs.
    timeout_s: float = Field(30.0, gt=0)
    # the reward of a code answer in training: all_pass (the AReaL paper's: reward_correct only if every
    # test passes, else reward_wrong) or fraction (reward_wrong + share of tests passed x (reward_correct
    # - reward_wrong); each failing test costs one more sandbox run). Accuracy and evaluation are all-pass.
    code_reward: Literal["all_pass", "fraction"] = "all_pass"
    # grade code even where the sandbox lacks a guarantee (sandbox.guarantees: no network, hidden host files,
    # confined writes, bounded disk, own user id, every process killed, limits on an answer's processes
    # together, the system call filter; e.g. the rlimits mode in a container without CAP_SYS_ADMIN). False:
    # training and evaluation refuse to grade code there (sandbox.WeakSandboxError, naming what is missing);
    # True: they grade, and log a warning naming it. A policy under RL learns to use whatever the sandbox lets
    # a program reach (the expected outputs in the checkout, the scheduler's port), and an evaluated model's
    # programs reach the same. Default: the environment's AREAL_ALLOW_WEAK_SANDBOX=1 (for `areal-flow eval`,
    # which takes no reward config), else False.
    allow_weak_sandbox: bool = Field(default_factory=lambda: os.environ.get("AREAL_ALLOW_WEAK_SANDBOX") == "1")

    @model_validator(mode="after")
    def _tls_files_with_a_tls_scheduler(self):
        files = {k: getattr(self, k) for k in ("tls_ca_file", "tls_client_cert", "tls_client_key")}
        address = self.scheduler_address or ""
        if address.startswith("tls://") and not (self.tls_ca_file and self.tls_client_cert):
            raise ValueError(
                f"reward.scheduler_address {address} is tls://: give reward.tls_ca_file and "
                "tls_client_cert (and tls_client_key unless the certificate file holds the key)"
            )
        given = [k for k, v in files.items() if v]
        if given and not address.startswith("tls://"):
            raise ValueError(
                f"reward.{', '.join(given)}: only for a tls:// reward.scheduler_address (a local "
                "cluster makes its own certificates)"
            )
        return self
