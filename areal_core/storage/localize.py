"""Turn a model folder given as a local path or fsspec URL into a local folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import fsspec


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def localize(url: str, cache_dir: str | None = None, fs: fsspec.AbstractFileSystem | None = None) -> str:
    """Return a local folder holding the files of ``url``.

    Local paths are returned as they are. Remote folders are copied once into
    ``cache_dir`` (default: a per-user temp folder), under a name derived from the
    URL, through a temporary folder renamed into place, so a half-copied folder
    is never returned. ``fs``: the filesystem to read remote URLs with (default:
    fsspec's for the URL's protocol).
    """
    if is_local(url):
        return local_path(url)
    cache = Path(cache_dir or os.path.join(tempfile.gettempdir(), "areal-flow-cache"))
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / hashlib.sha256(url.encode()).hexdigest()[:24]
    if dest.is_dir():
        return str(dest)
    if fs is None:
        fs, root = fsspec.core.url_to_fs(url)
    else:
        root = fs._strip_protocol(url)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".partial-"))
    try:
        for remote in fs.find(root):
            rel = remote[len(root.rstrip("/")) + 1 :]
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race; its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(dest)
