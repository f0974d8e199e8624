"""Which config keys a run may change and keep its identity: where its servers and reward workers are
(``WHERE_KEYS``: a campaign reuses a finished run whose config differs in them alone) and, beyond
those, what a resumed run may change (``MUTABLE_KEYS``). Plain data, no torch: a campaign compares
configs before anything is imported for training."""

from __future__ import annotations

from typing import Any

# config keys that say where a run's servers, reward workers and pools are, how many reward workers
# there are, and how the run reaches them: they change nothing the run computes (a campaign reuses a
# finished run whose config differs in them alone, as a resumed run may change them)
WHERE_KEYS = (
    "reward.scheduler_address",
    "reward.n_workers",
    "reward.tls_ca_file",
    "reward.tls_client_cert",
    "reward.tls_client_key",
    "rollout.backend.urls",
    "rollout.backend.api_key_file",
    "rollout.backend.api_key_env",
    "rollout.backend.allow_unauthenticated",
    "rollout.urls",
    "rollout.join_from",
    # where the pools run (a run stopped on one cluster may continue on another)
    "cluster",
)
# config keys a resumed run may change; everything else must match the stopped run
MUTABLE_KEYS = (
    "trainer.max_steps",
    "eval",
    *WHERE_KEYS,
    "rollout.request_timeout_s",
    "rollout.min_servers",
    "storage.keep_last",
    "storage.checkpoint_every",
    "storage.checkpoint_every_s",
    "storage.format",
    "storage.full_every",
    # a run stopped by its budget continues once the budget is raised
    "cost",
)
REMOVED_KEYS = ("log_every",)  # no longer in the config: a run saved with them still resumes


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_differences(saved: dict, current: dict, may_differ: tuple[str, ...] = MUTABLE_KEYS) -> list[str]:
    """Keys (dotted) whose values differ, except those under ``may_differ`` (by default those a resume
    may change) and those that were removed."""
    a, b = _flat(saved), _flat(current)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [k for k in keys if not any(k == m or k.startswith(m + ".") for m in may_differ + REMOVED_KEYS)]
