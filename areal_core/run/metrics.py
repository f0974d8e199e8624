"""Per-step metrics and the trained-trajectory ledger, written atomically as parquet."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pandas as pd

from areal_core.storage.fsutil import write_parquet_atomic

LEDGER_COLUMNS = [
    "trajectory_id",
    "step",
    "trained_by_version",
    "admit_version",
    "min_token_version",
    "max_token_version",
    "n_tokens",
    "reward",
    # the agent (multi-agent runs; "" otherwise), the behaviour version (the oldest policy
    # token's) and the version the trainer used as the proximal policy (None: the naive
    # objective has none). A ledger saved before these columns existed reads them as missing.
    "agent_id",
    "policy_version",
    "prox_version",
    # the Dask worker that graded it (its address)
    "graded_by",
]


def _policy_versions(t) -> list[int]:
    """The versions of the tokens the policy sampled (environment tokens of a multi-turn answer excluded)."""
    if not t.output_mask:
        return t.output_versions
    return [v for v, m in zip(t.output_versions, t.output_mask) if m]


def ledger_rows(batch, step: int, version: int, prox_version: int | None = None) -> list[dict]:
    """One row per trajectory of ``batch``, trained at ``step`` by the policy at ``version``."""
    rows = []
    for t in batch:
        versions = _policy_versions(t)
        rows.append(
            {
                "trajectory_id": t.traj_id,
                "step": step,
                "trained_by_version": version,
                "admit_version": t.admit_version,
                "min_token_version": min(versions),
                "max_token_version": max(versions),
                "n_tokens": len(t.output_ids),
                "reward": t.reward,
                "agent_id": t.agent_id,
                "policy_version": min(versions),
                "prox_version": prox_version,
                "graded_by": t.reward_info.get("graded_by", ""),
            }
        )
    return rows


class RunLog:
    """Rows of metrics (one per step) and ledger rows (one per trained trajectory)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.metrics: list[dict] = []
        self.ledger: list[dict] = []
        self._flushed_at = -float("inf")

    def log_step(self, row: dict, trained: list[dict], flush: bool = True) -> None:
        """``trained``: one ledger row per trained trajectory (see ``LEDGER_COLUMNS``)."""
        self.metrics.append(row)
        self.ledger.extend(trained)
        if flush:
            self.flush()

    def ledger_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.ledger, columns=LEDGER_COLUMNS)

    def to_parquet_bytes(self) -> dict[str, bytes]:
        """{"metrics.parquet": ..., "ledger.parquet": ...}: what a resumable state stores."""
        out = {}
        for name, df in (("metrics.parquet", pd.DataFrame(self.metrics)), ("ledger.parquet", self.ledger_frame())):
            buf = io.BytesIO()
            df.to_parquet(buf, index=False)
            out[name] = buf.getvalue()
        return out

    def restore(self, metrics: bytes, ledger: bytes) -> None:
        """Replace the rows with those of a saved state (see ``to_parquet_bytes``) and flush."""
        m, led = pd.read_parquet(io.BytesIO(metrics)), pd.read_parquet(io.BytesIO(ledger))
        self.metrics = [{k: _plain(v) for k, v in r.items()} for r in m.to_dict("records")]
        self.ledger = [_with_new_columns({k: _plain(v) for k, v in r.items()}) for r in led.to_dict("records")]
        self.flush()

    def flush(self, min_interval_s: float = 0.0) -> None:
        """Write both files whole; with ``min_interval_s``, only if the last write is older than that
        (the files grow with the run: writing them every step cost the trainer's thread O(steps))."""
        now = time.monotonic()
        if now - self._flushed_at < min_interval_s:
            return
        self._flushed_at = now
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(pd.DataFrame(self.metrics), self.run_dir / "metrics.parquet")
        write_parquet_atomic(self.ledger_frame(), self.run_dir / "ledger.parquet")


def _with_new_columns(row: dict) -> dict:
    """A ledger row saved before the newer columns: no agent, the behaviour version its oldest
    token's, the proximal version unknown (None), the grading worker unknown ("")."""
    row.setdefault("agent_id", "")
    row.setdefault("policy_version", row.get("min_token_version"))
    row.setdefault("prox_version", None)
    row.setdefault("graded_by", "")
    return row


def _plain(v):
    """numpy scalars from a parquet round trip -> Python numbers (rows stay JSON-friendly)."""
    return v.item() if hasattr(v, "item") else v


def check_ledger(ledger: pd.DataFrame, expected_steps: int, batch_size: int, eta: int | None = None) -> dict:
    """Exactly-once check: no trajectory id trained twice, every step trained B of them; with
    ``eta``, also the staleness bound on every trained token.

    "None lost": trajectories are admitted in whole groups and trained in whole groups,
    so with every step holding exactly B ids and none repeated, no admitted trajectory
    was dropped from a batch; ``incomplete_groups`` lists groups trained only in part.

    Staleness: a token sampled by version w and trained by the policy at version i is i - w
    versions stale; a trajectory's stalest token is its oldest, ``min_token_version`` (the policy's
    tokens only), so ``trained_by_version - min_token_version <= eta`` on every row is the bound on
    every token. ``max_token_staleness`` is the largest over the run, ``stale_trajectories`` the ids
    over ``eta``."""
    dup = ledger["trajectory_id"][ledger["trajectory_id"].duplicated()].tolist()
    per_step = ledger.groupby("step").size()
    bad_steps = per_step[per_step != batch_size].to_dict()
    missing_steps = sorted(set(range(1, expected_steps + 1)) - set(per_step.index.tolist()))
    groups = ledger["trajectory_id"].str.rsplit("-s", n=1).str[0]
    sizes = groups.groupby(groups).size()
    incomplete = sizes[sizes != sizes.max()].index.tolist() if len(sizes) else []
    staleness = ledger["trained_by_version"] - ledger["min_token_version"]
    stale = ledger["trajectory_id"][staleness > eta].tolist() if eta is not None else []
    ok = not dup and not bad_steps and not missing_steps and not incomplete and not stale
    return {
        "ok": ok,
        "duplicates": dup[:20],
        "bad_steps": bad_steps,
        "missing_steps": missing_steps,
        "incomplete_groups": incomplete[:20],
        "n_trained": len(ledger),
        "max_token_staleness": int(staleness.max()) if len(ledger) else None,
        "eta": eta,
        "stale_trajectories": stale[:20],
        "n_stale": len(stale),
    }
