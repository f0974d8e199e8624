"""The project's standard record schema, and reading/writing record files.

A records file is ``.jsonl`` (one JSON object per line) or ``.parquet``, at a
local path, a ``file://`` URL or any fsspec URL (``s3://...``). Every row is
validated; a bad row raises :class:`RecordError` naming the file, the line
(jsonl, 1-based) or row index (parquet, 0-based), the field and what was
expected.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from areal_core.data.code_tests import TestCaseError, check_test_case, shared_testtype
from areal_core.storage.fsutil import filesystem, write_bytes_atomic

CodeTest = Annotated[dict, AfterValidator(check_test_case)]  # a test case in the grader's format


class Record(BaseModel):
    """One problem: a prompt plus what a grader needs to judge an answer."""

    model_config = ConfigDict(extra="forbid")

    id: str
    task: Literal["chain", "math", "code"]
    prompt: str
    answer: str = ""
    solution: str | None = None
    tests: list[CodeTest] | None = None  # code records only: the unit tests (areal_core.data.code_tests)
    source: str = ""
    meta: dict = {}

    @model_validator(mode="after")
    def _tests_fit_task(self) -> Record:
        if self.task != "code":
            if self.tests:
                raise ValueError(f"field 'tests': only code records carry tests (this one's task is {self.task!r})")
            return self
        try:
            shared_testtype(self.tests or [])
        except ValueError as e:
            raise ValueError(f"field 'tests': {e}") from None
        return self


class RecordError(ValueError):
    """A records file holds a row that is not a valid :class:`Record`."""


def _format(kind: str) -> str:
    base = kind.split("?", 1)[0].lower()
    if base.endswith(".jsonl"):
        return "jsonl"
    if base.endswith(".parquet"):
        return "parquet"
    raise RecordError(f"{kind}: unknown records format (expected a .jsonl or .parquet file)")


def describe_validation_error(err: ValidationError) -> str:
    """Each of a record's validation errors as ``field 'F': what was wrong``, joined by '; '."""
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<row>"
        if e["type"] == "value_error":  # our own checks: the message says what was wrong and what came
            cause = e.get("ctx", {}).get("error")
            if isinstance(cause, TestCaseError) and cause.field is not None:  # e.g. field 'tests.2.fn_name'
                field, msg = f"{field}.{cause.field}", cause.reason
            else:
                msg = e["msg"].removeprefix("Value error, ")
            parts.append(msg if field == "<row>" else f"field '{field}': {msg}")
            continue
        got = e.get("input")
        got_s = "missing" if e["type"] == "missing" else f"got {type(got).__name__} {got!r:.60}"
        parts.append(f"field '{field}': {e['msg']} ({got_s})")
    return "; ".join(parts)


def _validate(row: Any, where: str) -> Record:
    if not isinstance(row, dict):
        raise RecordError(f"{where}: expected a JSON object (a record), got {type(row).__name__}")
    if isinstance(row.get("id"), str):
        where = f"{where} (record {row['id']!r})"
    try:
        return Record.model_validate(row)
    except ValidationError as e:
        raise RecordError(f"{where}: {describe_validation_error(e)}") from None


def _read_jsonl(f, url: str) -> list[Record]:
    out = []
    for lineno, raw_bytes in enumerate(f, start=1):
        try:
            raw = raw_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(f"{url}, line {lineno}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RecordError(f"{url}, line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        out.append(_validate(row, f"{url}, line {lineno}"))
    return out


def _read_parquet(f, url: str) -> list[Record]:
    import pyarrow.parquet as pq

    table = pq.read_table(f)
    out = []
    for idx, row in enumerate(table.to_pylist()):
        # Parquet has one schema for all rows: optional columns absent from the
        # writer's records come back as None; drop those so defaults apply.
        for key in ("answer", "source", "meta"):
            if key in row and row[key] is None:
                del row[key]
        if "meta" in row and isinstance(row["meta"], str):
            row["meta"] = _json_field(row["meta"], f"{url}, row {idx}", "meta")
        if "tests" in row and isinstance(row["tests"], str):
            row["tests"] = _json_field(row["tests"], f"{url}, row {idx}", "tests")
        out.append(_validate(row, f"{url}, row {idx}"))
    return out


def _json_field(text: str, where: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"{where}: field '{field}': expected JSON text ({e.msg})") from None


def read_records(url: str) -> list[Record]:
    """Read and validate every record of a ``.jsonl`` or ``.parquet`` file."""
    fmt = _format(url)
    fs, path = filesystem(url)  # the project's S3 settings (endpoint and credentials from the environment)
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise RecordError(f"{url}: no such records file") from None
    with f:
        if fmt == "jsonl":
            return _read_jsonl(f, url)
        return _read_parquet(f, url)


def _encode(records: list[Record], fmt: str) -> bytes:
    rows = [r.model_dump() for r in records]
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    # meta and tests are free-form dicts: store them as JSON text so that one
    # parquet schema holds any content (read_records decodes them back).
    for r in rows:
        r["meta"] = json.dumps(r["meta"], ensure_ascii=False)
        r["tests"] = None if r["tests"] is None else json.dumps(r["tests"], ensure_ascii=False)
    schema = pa.schema([(name, pa.string()) for name in Record.model_fields])
    table = pa.Table.from_pylist(rows, schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_records(records: Iterable[Record | dict], url: str) -> None:
    """Write records to ``url`` (.jsonl or .parquet) atomically.

    The whole file is encoded in memory first, so a record that fails
    validation or encoding never touches storage.

    Local: written to a temp file in the destination folder, fsynced, then
    ``os.replace``-d into place; on any error the temp file is removed and the
    old file (if any) is untouched.

    Remote (fsspec, e.g. s3://): the final key is written with a single
    ``pipe`` (one PUT). An object store exposes a key only once its upload
    completes, so readers see either the previous object or the whole new
    one; a temp key + copy + delete would add two requests and a window where
    a stray temp object can be left behind, for no gain in atomicity.
    Both are ``storage.fsutil.write_bytes_atomic``.
    """
    fmt = _format(url)
    recs = [r if isinstance(r, Record) else _validate(r, f"{url}, record {i}") for i, r in enumerate(records)]
    data = _encode(recs, fmt)
    write_bytes_atomic(url, data)
