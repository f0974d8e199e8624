"""Turn a training or benchmark set into the project's record schema, in object storage.

``prepare(source, out_url)``:

* ``source="synthetic"``: the chain task's train and held-out splits (from a
  ``SyntheticTask`` config), written as ``<out_url>/train.<fmt>`` and ``<out_url>/eval.<fmt>``;
* any other name: ``areal_core.data.sources.read_source(name, path=None)`` reads a
  dataset in its own format (the files in ../shared/data) and returns records; they
  are written as ``<out_url>/<name>.<fmt>``.

Every row is validated (:class:`~areal_core.data.records.RecordError` names the file,
the line and the field), every record is checked before anything is written, and each
file is written atomically (``write_records``): a failed preparation leaves nothing
half-written. A ``manifest.json`` listing the files and their record counts is
written last.
"""

from __future__ import annotations

from collections import Counter

from pydantic import ValidationError

from areal_core.data.config import SyntheticTask
from areal_core.data.records import Record, RecordError, write_records
from areal_core.data.synthetic import ChainTask
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
        fields = "; ".join(f"field '{'.'.join(map(str, err['loc'])) or '<row>'}': {err['msg']}" for err in e.errors())
        raise RecordError(f"{where}: {fields}") from None


def read_named_source(name: str, path: str | None = None) -> list[Record]:
    """Records of a named dataset, through ``areal_core.data.sources.read_source``."""
    from areal_core.data.sources import read_source  # the per-format readers live there

    return read_source(name, path=path)


def split_records(source: str, path: str | None = None,
                  synthetic: SyntheticTask | dict | None = None) -> dict[str, list[Record]]:
    """``{split name: records}`` for a source, fully validated, nothing written."""
    if source == "synthetic":
        cfg = synthetic if isinstance(synthetic, SyntheticTask) else SyntheticTask(**(synthetic or {}))
        task = ChainTask(cfg)
        splits = {"train": task.train_records(), "eval": task.eval_records()}
    else:
        splits = {source: read_named_source(source, path)}
    for name, recs in splits.items():
        if not recs:
            raise RecordError(f"{source}: split {name!r} has no records")
        # read_source validates as it reads; re-validate so that any reader's output is checked
        splits[name] = [_validated(r, f"{source}/{name}, record {i}") for i, r in enumerate(recs)]
        _check_unique_ids(splits[name], f"{source}/{name}")
    return splits


def prepare(source: str, out_url: str, *, path: str | None = None,
            synthetic: SyntheticTask | dict | None = None, fmt: str = "parquet") -> dict:
    """Validate a source and write its records under ``out_url``; return ``{split: url}`` and counts."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    splits = split_records(source, path, synthetic)  # everything validated before any write
    files, counts = {}, {}
    for name, recs in splits.items():
        url = join(out_url, f"{name}.{fmt}")
        write_records(recs, url)
        files[name], counts[name] = url, len(recs)
    manifest = {"source": source, "path": path, "files": files, "counts": counts}
    write_json_atomic(join(out_url, "manifest.json"), manifest)
    return manifest
