"""Turn the config's data section into train and held-out prompts for a tokenizer."""

from __future__ import annotations

from areal_core.data.config import DataConfig
from areal_core.data.prompting import encode_prompt
from areal_core.data.records import Record, read_records
from areal_core.data.tasks import synthetic_task
from areal_core.types import Prompt


def load_records(cfg: DataConfig) -> tuple[list[Record], list[Record]]:
    """(train records, held-out records)."""
    if cfg.dataset == "synthetic":
        task = synthetic_task(cfg.synthetic)
        train, held_out = task.train_records(), task.eval_records()
    else:
        train = read_records(cfg.dataset)
        held_out = []
    if cfg.eval_dataset is not None:
        held_out = read_records(cfg.eval_dataset)
    if not held_out:
        raise ValueError("no held-out problems: set data.eval_dataset for a non-synthetic data.dataset")
    return train, held_out


def to_prompts(
    records: list[Record], tokenizer, instruction: str | None = None, buckets: list[str] | None = None
) -> list[Prompt]:
    """Prompts for the controller; ``buckets``: each record's curriculum bucket (see :func:`bucket`)."""
    buckets = buckets if buckets is not None else [None] * len(records)
    if len(buckets) != len(records):
        raise ValueError(f"{len(buckets)} buckets for {len(records)} records")
    return [
        Prompt(
            id=r.id,
            task=r.task,
            input_ids=encode_prompt(tokenizer, r, instruction),
            reference=reference(r),
            bucket=b,
            tests=r.tests,
        )
        for r, b in zip(records, buckets)
    ]


def bucket(record: Record, field: str) -> str:
    """The record's curriculum bucket: its ``meta[field]``, as text."""
    if field not in record.meta or record.meta[field] is None:
        raise ValueError(
            f"data.curriculum.by is {field!r}, but record {record.id} has no meta field {field!r} "
            f"(its meta fields: {sorted(record.meta) or 'none'})"
        )
    return str(record.meta[field])


def reference(record: Record) -> str:
    """What the grader compares a response with: the whole chain for the chain task (code is
    graded against the record's tests, which the prompt carries)."""
    if record.task == "chain":
        if not record.solution:
            raise ValueError(f"chain record {record.id} has no solution to grade against")
        return record.solution
    return record.answer
