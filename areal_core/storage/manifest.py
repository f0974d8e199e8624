"""The checkpoint manifest: its format and validation (see ``checkpoints.py``)."""

from __future__ import annotations

import json
import re
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "areal-checkpoint/1"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    return version


def check_meta(meta: dict | None) -> None:
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise ValueError(f"meta must be JSON-serialisable: {err}") from err


def path_problem(p: Any) -> str | None:
    if not isinstance(p, str) or not p:
        return "not a non-empty string"
    if p.startswith("/") or ".." in p.split("/") or "\\" in p or "\x00" in p:
        return "not a plain relative path"
    return "the manifest's own name" if p == MANIFEST else None


def manifest_problem(m: Any, version: int) -> str | None:
    if not isinstance(m, dict):
        return f"expected a JSON object, got {type(m).__name__}"
    if m.get("format") != FORMAT:
        return f"format {m.get('format')!r} != {FORMAT!r}"
    if m.get("version") != version:
        return f"version {m.get('version')!r} != {version} (the folder's)"
    if not isinstance(m.get("meta"), dict):
        return "'meta' is not an object"
    if not isinstance(m.get("created"), str):
        return "'created' missing"
    files = m.get("files")
    if not isinstance(files, list) or not files:
        return "'files' is not a non-empty list"
    for e in files:
        if not isinstance(e, dict):
            return f"file entry {e!r} is not an object"
        p = e.get("path")
        if path_problem(p):
            return f"bad file path {p!r}: {path_problem(p)}"
        if isinstance(e.get("size"), bool) or not isinstance(e.get("size"), int) or e["size"] < 0:
            return f"{p}: bad size {e.get('size')!r}"
        if not isinstance(e.get("sha256"), str) or not _SHA256.match(e["sha256"]):
            return f"{p}: bad sha256 {e.get('sha256')!r}"
    return None
