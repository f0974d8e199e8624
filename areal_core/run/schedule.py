"""A run's schedule: what entered each training step, so that any step can be trained again.

For every step the run writes ``schedule/step-<N>.parquet`` in its folder: one row per trajectory,
in the order the trainer took them, with everything the trainer reads (prompt and answer tokens,
behaviour logprobs, per-token versions, reward, group) and the trajectory's sampling seed; its
metadata holds the step, the version that trained it and the trainer's plan (minibatches and
micro-batches, as indices into the batch). ``schedule/meta.json`` holds what a replay must repeat
of the trainer itself: its thread count (and the cores it borrowed), its dtype, the run's total steps
(the lr schedule's length) and the CPU kind and kernels it ran on (``numerics.cpu_kind``).
Each checkpoint carries the steps since the previous one (``resume/schedule.parquet``), so a
run folder's checkpoints alone can be replayed. The trainer has no random state of its own:
given the batch and its order, its step is a function of the weights and optimizer state.

``areal-flow replay`` (``replay.py``) reads it back.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from areal_core.storage import write_json_atomic
from areal_core.storage.fsutil import write_bytes_atomic
from areal_core.types import Trajectory

SCHEDULE_DIR = "schedule"
META_FILE = "meta.json"
CHECKPOINT_FILE = "resume/schedule.parquet"
FORMAT = "areal-schedule/1"


def step_file(step: int) -> str:
    return f"step-{step:06d}.parquet"


class ScheduleLog:
    """Writes a run's schedule as it trains (see the module docstring)."""

    def __init__(self, run_dir: str | Path, meta: dict):
        self.dir = Path(run_dir) / SCHEDULE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(str(self.dir / META_FILE), {"format": FORMAT, **meta})
        self._since_checkpoint: list[pa.Table] = []

    def record(
        self, step: int, version: int, batch: list[Trajectory], seeds: list[int | None], plan: dict | None
    ) -> int:
        """Write step ``step``'s schedule (trained by ``version``); returns its size in bytes."""
        table = to_table(step, batch, seeds).replace_schema_metadata(
            {"areal": json.dumps({"format": FORMAT, "step": step, "version": version, "plan": plan})}
        )
        data = _parquet_bytes(table)
        write_bytes_atomic(str(self.dir / step_file(step)), data)
        self._since_checkpoint.append(table)
        return len(data)

    def checkpoint_bytes(self) -> bytes:
        """The steps recorded since the last call, as one parquet file (each step's metadata kept in
        a column); empty tables make an empty file."""
        tables, self._since_checkpoint = self._since_checkpoint, []
        if not tables:
            return b""
        metas = [t.schema.metadata[b"areal"].decode() for t in tables]
        joined = pa.concat_tables(
            [
                t.replace_schema_metadata(None).append_column("step_meta", pa.array([m] * t.num_rows))
                for t, m in zip(tables, metas)
            ]
        )
        return _parquet_bytes(joined)


def to_table(step: int, batch: list[Trajectory], seeds: list[int | None]) -> pa.Table:
    rows = []
    for order, (t, seed) in enumerate(zip(batch, seeds)):
        row = t.to_row()
        # (where it was graded is the ledger's; left out, a schedule depends on what was trained alone)
        info = {k: v for k, v in row["reward_info"].items() if k != "graded_by"}
        row["reward_info"] = json.dumps(info, default=str)
        rows.append({"step": step, "order": order, "sampling_seed": seed, **row})
    return pa.Table.from_pylist(rows)


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


class ScheduleError(ValueError):
    """A run folder whose schedule is missing or unreadable for the steps asked for."""


def read_meta(run_dir: str | Path) -> dict:
    path = Path(run_dir) / SCHEDULE_DIR / META_FILE
    if not path.is_file():
        raise ScheduleError(
            f"{path}: not found; the run recorded no schedule (made by an areal-flow "
            "that did not record one), so it cannot be replayed"
        )
    return json.loads(path.read_text())


def read_step(run_dir: str | Path, step: int) -> tuple[list[Trajectory], dict]:
    """Step ``step``'s batch, in the trainer's order, and its metadata (version, plan)."""
    path = Path(run_dir) / SCHEDULE_DIR / step_file(step)
    if not path.is_file():
        raise ScheduleError(f"{path}: not found; the run's schedule has no step {step}")
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"areal"])
    batch = []
    for row in sorted(table.to_pylist(), key=lambda r: r["order"]):
        row["reward_info"] = json.loads(row["reward_info"])
        batch.append(Trajectory.from_row(row))
    return batch, meta
