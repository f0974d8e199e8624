"""The list of rollout servers that join a running run (``rollout.join_from``): base URLs, one per
line, ``#`` comments and blank lines skipped, at a path or fsspec URL. Servers add themselves once
they serve and take themselves out when they stop (``areal-flow rollout-server --announce``, the
serve flow's ``join_run``); the run reads it every few seconds (``controller/elastic.py``).

Several writers at once (a Slurm job array's servers starting together) take turns on a local or
shared-folder list: each rewrite holds an exclusive ``flock`` on ``<list>.lock`` beside it. On object
storage (s3://) there is no lock: one writer at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os

from areal_core.storage.fsutil import filesystem, invalidate, write_text_atomic
from areal_core.storage.localize import is_local, local_path


def read_urls(path: str) -> list[str]:
    """The base URLs listed at ``path`` now (no file yet: none)."""
    fs, p = filesystem(path)
    invalidate(fs, p)
    if not fs.exists(p):
        return []
    text = fs.cat_file(p).decode()
    urls = [line.split("#", 1)[0].strip().rstrip("/") for line in text.splitlines()]
    return [u for u in urls if u]


@contextlib.contextmanager
def _turn(path: str):
    """Hold the list's lock file (local paths; nothing for object storage)."""
    if not is_local(path):
        yield
        return
    target = local_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    with open(target + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def announce(path: str, urls: list[str], present: bool = True) -> None:
    """Add ``urls`` to the list at ``path``, or with ``present=False`` take them out; the file is
    rewritten whole (atomically), holding the list's lock."""
    urls = [u.rstrip("/") for u in urls]  # (as read_urls reads them)
    with _turn(path):
        now = read_urls(path)
        new = now + [u for u in urls if u not in now] if present else [u for u in now if u not in urls]
        write_text_atomic(path, "".join(f"{u}\n" for u in new))
