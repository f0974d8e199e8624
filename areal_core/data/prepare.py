"""Turn a training or benchmark set into the project's record schema, in object storage.

``prepare(source, out_url)``:

* ``source="synthetic"``: a synthetic task's train and held-out splits (the chain task, or
  the code task for settings with ``kind: code``: ``data.synthetic`` of a config), written as
  ``<out_url>/train.<fmt>`` and ``<out_url>/eval.<fmt>``;
* any other name: ``areal_core.data.sources.read_source(name, path=None)`` reads a
  dataset in its own format (its file in data/; one not shipped from a ``shared/data`` folder
  next to the repository's folder, see data/SOURCES.md) and returns records; they are
  written as ``<out_url>/<name>.<fmt>``. A training set with evaluation sources to stay
  apart from (``Source.held_out_from``: the LiveCodeBench and LeetCode train splits)
  loses the problems that are also in one of them (``areal_core.data.overlap``); the
  manifest lists each one left out and why.

Every row is validated (:class:`~areal_core.data.records.RecordError` names the file,
the line and the field), every record is checked before anything is written, and each
file is written atomically (``write_records``): a failed preparation leaves nothing
half-written. A ``manifest.json`` listing the files, their record counts and where
the data came from (the source's origin, the file read and its sha256) is written last.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from pydantic import ValidationError

from areal_core.data.config import DataConfig, SyntheticArithTask, SyntheticCodeTask, SyntheticTask
from areal_core.data.records import Record, RecordError, describe_validation_error, write_records
from areal_core.data.tasks import synthetic_task
from areal_core.storage.fsutil import join, write_json_atomic

FORMATS = ("parquet", "jsonl")


def _check_unique_ids(records: list[Record], what: str) -> None:
    dup = [i for i, n in Counter(r.id for r in records).items() if n > 1]
    if dup:
        raise RecordError(f"{what}: {len(dup)} duplicate record id(s), e.g. {dup[:3]}")


def _validated(row: Record | dict, where: str) -> Record:
    try:
        return Record.model_validate(row.model_dump() if isinstance(row, Record) else row)
    except ValidationError as e:
        raise RecordError(f"{where}: {describe_validation_error(e)}") from None


def read_named_source(name: str, path: str | None = None) -> list[Record]:
    """Records of a named dataset, through ``areal_core.data.sources.read_source``."""
    from areal_core.data.sources import read_source  # the per-format readers live there

    return read_source(name, path=path)


def held_out_overlaps(source: str, records: list[Record]) -> tuple[list[Record], list[dict]]:
    """``(records, [])`` for most sources; for a training set with evaluation sources to stay apart
    from, ``(the records that are no problem of theirs, the overlaps left out)``."""
    from areal_core.data.overlap import split_off_overlaps
    from areal_core.data.sources import SOURCES, read_source

    src = SOURCES.get(source)
    if src is None or not src.held_out_from:
        return records, []
    held_out = [r for name in src.held_out_from for r in read_source(name)]
    kept, dropped = split_off_overlaps(records, held_out)
    return kept, [d.as_dict() for d in dropped]


def split_records(
    source: str,
    path: str | None = None,
    synthetic: SyntheticTask | SyntheticCodeTask | SyntheticArithTask | dict | None = None,
) -> tuple[dict[str, list[Record]], list[dict]]:
    """``({split name: records}, overlaps left out)`` for a source, fully validated, nothing written."""
    left_out: list[dict] = []
    if source == "synthetic":
        cfg = (
            synthetic
            if isinstance(synthetic, (SyntheticTask, SyntheticCodeTask, SyntheticArithTask))
            else DataConfig(synthetic=synthetic or {}).synthetic
        )
        task = synthetic_task(cfg)
        splits = {"train": task.train_records(), "eval": task.eval_records()}
    else:
        splits = {source: read_named_source(source, path)}
    for name, recs in splits.items():
        if not recs:
            raise RecordError(f"{source}: split {name!r} has no records")
        # read_source validates as it reads; re-validate so that any reader's output is checked
        splits[name] = [_validated(r, f"{source}/{name}, record {i}") for i, r in enumerate(recs)]
        _check_unique_ids(splits[name], f"{source}/{name}")
    if source in splits:
        splits[source], left_out = held_out_overlaps(source, splits[source])
    return splits, left_out


def _provenance(source: str, path: str | None) -> dict:
    """Where a named source's records came from: its upstream origin, and the file read with its sha256."""
    from areal_core.data.sources import SOURCES, source_path

    if source not in SOURCES:
        return {}
    read = path or source_path(source)
    with open(read, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"origin": SOURCES[source].origin, "file": read, "sha256": digest}


def prepare(
    source: str,
    out_url: str,
    *,
    path: str | None = None,
    synthetic: SyntheticTask | SyntheticCodeTask | SyntheticArithTask | dict | None = None,
    fmt: str = "parquet",
) -> dict:
    """Validate a source and write its records under ``out_url``; return ``{split: url}`` and counts."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    splits, left_out = split_records(source, path, synthetic)  # everything validated before any write
    files, counts = {}, {}
    for name, recs in splits.items():
        url = join(out_url, f"{name}.{fmt}")
        write_records(recs, url)
        files[name], counts[name] = url, len(recs)
    manifest = {"source": source, "path": path, "files": files, "counts": counts, **_provenance(source, path)}
    if left_out:
        manifest["left_out_as_evaluation_problems"] = left_out
    write_json_atomic(join(out_url, "manifest.json"), manifest)
    return manifest
