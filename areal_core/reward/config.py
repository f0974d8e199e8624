from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from areal_core.configbase import Section


class RewardConfig(Section):
    # None: start a local Dask cluster (scheduler + workers, each a process, over TLS with certificates made
    # for the run); else an existing scheduler: tls://host:port (with the tls_* files below), or tcp:// (no
    # authentication: any process that reaches it can run code there; logged as a warning)
    scheduler_address: str | None = None
    tls_ca_file: str | None = (
        None  # tls:// scheduler: the CA certificate (PEM) the cluster's certificates are signed by
    )
    tls_client_cert: str | None = None  # tls:// scheduler: this run's client certificate (PEM), signed by that CA
    tls_client_key: str | None = None  # tls:// scheduler: its private key (PEM; None: in tls_client_cert)
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
