"""Versioned checkpoint streaming over fsspec (a local folder, file:// or s3://).

Layout::

    <url>/v<N>/model.safetensors, config.json, tokenizer files, ...
    <url>/v<N>/manifest.json      # written LAST

A version exists iff its ``manifest.json`` exists and is valid. The manifest lists
every file with its size and sha256, the version, the creation time and a
free-form ``meta`` dict. Every object is written atomically (local: temp name +
os.replace; S3: one PUT or a completed multipart upload), each write is retried
with exponential backoff on transient errors, and the manifest is written only
after every file is in place, so readers never see a partial version. ``prune``
deletes the manifest FIRST, so a reader never sees a manifest without its files; ``drop_files``
likewise rewrites a manifest without some of its files before it deletes them (what a finished run
no longer needs: its optimizer state).

A delta version (``writer.py``; meta ``format: delta``, ``base_version: B``) holds
``model.delta`` instead of ``model.safetensors``; ``local_copy`` rebuilds the full
folder from it and v<B>, and ``prune`` keeps v<B> while the delta is kept. A LoRA version
(meta ``format: lora``, ``base_version: 0``; ``adapters.py``) holds ``adapter.safetensors`` and
``adapter_config.json``; ``local_copy`` merges them into v0 the same way, and ``prune`` keeps v0.

S3 endpoint and credentials come from the environment (see ``fsutil``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from areal_core.storage import adapters
from areal_core.storage.delta import materialise
from areal_core.storage.fsutil import (
    FileData,
    filesystem,
    invalidate,
    is_local_fs,
    join,
    move_file_atomic,
    pipe_atomic,
    put_file_atomic,
    retry,
    write_local_file,
)
from areal_core.storage.localize import localize
from areal_core.storage.manifest import (
    FORMAT,
    MANIFEST,
    check_meta,
    check_version,
    manifest_problem,
    path_problem,
)

_VERSION_DIR = re.compile(r"^v(\d+)$")


class CheckpointError(RuntimeError):
    """Base class of checkpoint store errors."""


class VersionNotFoundError(CheckpointError, FileNotFoundError):
    """The version has no manifest: it does not exist or is incomplete."""


class ManifestError(CheckpointError, ValueError):
    """The manifest exists but is not a valid manifest."""


class VersionExistsError(CheckpointError):
    """Refusing to overwrite a complete version."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete version does not match its manifest."""


def _sha256_stream(f) -> str:
    h = hashlib.sha256()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()


def _local_files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


class CheckpointStore:
    """Publish and read complete, immutable model versions under ``url``."""

    def __init__(self, url: str, retries: int = 5, backoff_s: float = 0.5, cache_dir: str | None = None):
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.fs, self.root = filesystem(url)
        self.is_local = is_local_fs(self.fs)
        self.url = self.root if self.is_local else url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.cache_dir = cache_dir

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str) -> CheckpointStore:
        """From a ``StorageConfig``: url None -> <run_dir>/checkpoints, cache_dir None ->
        <run_dir>/.ckpt_cache."""
        return cls(
            cfg.url or os.path.join(run_dir, "checkpoints"),
            retries=cfg.retries,
            cache_dir=cfg.cache_dir or os.path.join(run_dir, ".ckpt_cache"),
        )

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    # -- paths ---------------------------------------------------------------
    def version_url(self, version: int) -> str:
        return join(self.url, f"v{check_version(version)}")

    def _vpath(self, version: int, name: str = "") -> str:
        base = join(self.root, f"v{check_version(version)}")
        return join(base, name) if name else base

    def _retry(self, fn, what: str):
        return retry(fn, retries=self.retries, backoff_s=self.backoff_s, what=what)

    # -- reading -----------------------------------------------------------
    def read_manifest(self, version: int) -> dict:
        """The validated manifest of ``version``; VersionNotFoundError or ManifestError."""
        path = self._vpath(version, MANIFEST)
        url = join(self.version_url(version), MANIFEST)

        def _read() -> bytes:
            invalidate(self.fs, path)
            return self.fs.cat_file(path)

        try:
            raw = self._retry(_read, f"read {url}")
        except FileNotFoundError as err:
            raise VersionNotFoundError(
                f"{url}: no manifest; version {version} does not exist or is incomplete"
            ) from err
        try:
            manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ManifestError(f"{url}: manifest is not valid JSON ({err})") from err
        problem = manifest_problem(manifest, version)
        if problem:
            raise ManifestError(f"{url}: invalid manifest: {problem}")
        return manifest

    def _is_complete(self, version: int) -> bool:
        try:
            self.read_manifest(version)
        except (VersionNotFoundError, ManifestError):
            return False
        return True

    def _candidates(self) -> list[int]:
        """Version numbers that have a folder (complete or not), sorted."""

        def _ls() -> list[str]:
            invalidate(self.fs, self.root)
            try:
                return self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []

        out = []
        for entry in self._retry(_ls, f"list {self.url}"):
            m = _VERSION_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.append(int(m.group(1)))
        return sorted(set(out))

    def versions(self) -> list[int]:
        """Complete versions, sorted ascending."""
        return [v for v in self._candidates() if self._is_complete(v)]

    def latest(self) -> int | None:
        for v in reversed(self._candidates()):
            if self._is_complete(v):
                return v
        return None

    def verify(self, version: int) -> dict:
        """Check every file's size and sha256 against the manifest; returns the manifest.

        Raises CorruptCheckpointError naming every mismatching or missing file."""
        manifest = self.read_manifest(version)
        problems = []
        invalidate(self.fs, self._vpath(version))
        for entry in manifest["files"]:
            path = self._vpath(version, entry["path"])

            def _check(path=path, entry=entry) -> str | None:
                try:
                    size = self.fs.info(path)["size"]
                except FileNotFoundError:
                    return f"{entry['path']}: missing"
                if size != entry["size"]:
                    return f"{entry['path']}: size {size} != {entry['size']}"
                with self.fs.open(path, "rb") as f:
                    digest = _sha256_stream(f)
                if digest != entry["sha256"]:
                    return f"{entry['path']}: sha256 {digest} != {entry['sha256']}"
                return None

            problem = self._retry(_check, f"verify {path}")
            if problem:
                problems.append(problem)
        if problems:
            raise CorruptCheckpointError(f"{self.version_url(version)}: " + "; ".join(problems))
        return manifest

    def local_copy(self, version: int) -> str:
        """A local folder holding ``version``, loadable with from_pretrained.

        Local stores: the version folder itself. Remote: a copy under cache_dir
        (made once; a cached copy whose manifest differs is made again). A delta
        version (meta ``format: delta``) is materialised once into a full folder
        (base + delta, bit for bit) under cache_dir (local stores without one:
        ``<store>/.full``), so readers need not know about deltas; so is a LoRA
        version (meta ``format: lora``: base v0 with its adapters merged, ``adapters.py``)."""
        manifest = self.read_manifest(version)
        raw = self._raw_local_copy(version, manifest)
        kind = manifest["meta"].get("format")
        if kind not in ("delta", adapters.FORMAT):
            return raw
        base = manifest["meta"].get("base_version")
        base_meta = self.read_manifest(check_version(base))["meta"]
        if base_meta.get("format") in ("delta", adapters.FORMAT):
            raise ManifestError(
                f"{self.version_url(version)}: its base v{base} is itself a {base_meta['format']} version"
            )
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]
        dest = os.path.join(self._full_dir(), f"{self._url_key(version)}-full-{digest}")
        build = materialise if kind == "delta" else adapters.materialise
        return build(raw, self.local_copy(base), dest)

    def loadable_url(self, version: int) -> str:
        """Where a process on another host loads ``version`` from (from_pretrained, or a rollout
        server's load from disk): the version's URL when it is stored whole; a delta or LoRA version,
        which needs its base, as this host's materialised copy (``local_copy``)."""
        kind = self.read_manifest(version)["meta"].get("format")
        return self.local_copy(version) if kind in ("delta", adapters.FORMAT) else self.version_url(version)

    def _url_key(self, version: int) -> str:
        return hashlib.sha256(self.version_url(version).encode()).hexdigest()[:16]

    def _full_dir(self) -> str:
        if self.cache_dir:
            return self.cache_dir
        if self.is_local:
            return os.path.join(self.root, ".full")
        return os.path.join(tempfile.gettempdir(), "areal-flow-cache")

    def _raw_local_copy(self, version: int, manifest: dict) -> str:
        if self.is_local:
            return self._vpath(version)
        url = self.version_url(version)
        for _ in range(2):
            invalidate(self.fs, self._vpath(version))
            dest = self._retry(lambda: localize(url, self.cache_dir, fs=self.fs), f"copy {url}")
            if self._local_matches(dest, manifest):
                return dest
            shutil.rmtree(dest, ignore_errors=True)
        raise CheckpointError(
            f"{url}: local copy in {dest} does not match the manifest (version changed or was pruned while copying)"
        )

    @staticmethod
    def _local_matches(folder: str, manifest: dict) -> bool:
        try:
            with open(os.path.join(folder, MANIFEST), "rb") as f:
                if json.loads(f.read()) != manifest:
                    return False
        except (OSError, ValueError):
            return False
        for entry in manifest["files"]:
            p = os.path.join(folder, *entry["path"].split("/"))
            if not os.path.isfile(p) or os.path.getsize(p) != entry["size"]:
                return False
        return True

    # -- writing -------------------------------------------------------------
    def publish(
        self,
        version: int,
        model: Any,
        tokenizer: Any = None,
        meta: dict | None = None,
        extra: dict[str, FileData] | None = None,
    ) -> str:
        """save_pretrained ``model`` (safetensors) and ``tokenizer`` and publish them as
        ``version``, with ``extra`` files ({relative path: ``fsutil.FileData``}, e.g. a run's resumable
        state) in the same version, so they appear with it or not at all. Returns the
        version folder URL."""
        check_version(version)
        check_meta(meta)
        for name in extra or {}:
            if path_problem(name):
                raise ValueError(f"extra file {name!r}: {path_problem(name)}")
        self._prepare_slot(version)  # fail before the (possibly long) save
        with tempfile.TemporaryDirectory(prefix="areal-ckpt-", dir=self.cache_dir and _makedirs(self.cache_dir)) as tmp:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for name, data in (extra or {}).items():
                write_local_file(os.path.join(tmp, *name.split("/")), data)
            return self.publish_folder(version, tmp, meta)

    def read_file(self, version: int, name: str) -> bytes:
        """One file of a complete version, checked against the manifest (size and sha256)."""
        manifest = self.read_manifest(version)
        entry = next((e for e in manifest["files"] if e["path"] == name), None)
        if entry is None:
            raise FileNotFoundError(f"{self.version_url(version)}: no file {name!r} in its manifest")
        path = self._vpath(version, name)
        data = self._retry(lambda: self.fs.cat_file(path), f"read {name} of {self.version_url(version)}")
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry["size"] or digest != entry["sha256"]:
            raise CorruptCheckpointError(
                f"{self.version_url(version)}/{name}: {len(data)} bytes, sha256 "
                f"{digest}; the manifest says {entry['size']} bytes, {entry['sha256']}"
            )
        return data

    def publish_folder(self, version: int, local_folder: str, meta: dict | None = None, move: bool = False) -> str:
        """Publish the files of an already saved model folder as ``version``.

        A ``manifest.json`` in the folder is ignored (it is written anew). ``move``
        (local stores, ``local_folder`` on the store's filesystem): rename the files
        into the version instead of copying them (each fsynced first)."""
        check_version(version)
        check_meta(meta)
        if not os.path.isdir(local_folder):
            raise FileNotFoundError(f"not a folder: {local_folder}")
        names = _local_files(local_folder)
        if not names:
            raise ValueError(f"nothing to publish in {local_folder}")
        files = []
        for name in names:
            src = os.path.join(local_folder, *name.split("/"))
            with open(src, "rb") as f:
                files.append({"path": name, "size": os.path.getsize(src), "sha256": _sha256_stream(f)})
        self._prepare_slot(version)
        for entry in files:
            src = os.path.join(local_folder, *entry["path"].split("/"))
            dest = self._vpath(version, entry["path"])
            place = move_file_atomic if move and self.is_local else put_file_atomic
            self._retry(
                lambda src=src, dest=dest, place=place: place(self.fs, src, dest),
                f"upload {entry['path']} to {self.version_url(version)}",
            )
        now = time.time()
        manifest = {
            "format": FORMAT,
            "version": version,
            "created": datetime.fromtimestamp(now, UTC).isoformat(),
            "created_unix": now,
            "files": files,
            "meta": dict(meta or {}),
        }
        data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        path = self._vpath(version, MANIFEST)
        self._retry(lambda: pipe_atomic(self.fs, path, data), f"write manifest of {self.version_url(version)}")
        return self.version_url(version)

    def _prepare_slot(self, version: int) -> None:
        """Refuse a complete version; remove a partial leftover of ``version``."""
        if self._is_complete(version):
            raise VersionExistsError(
                f"{self.version_url(version)} is already a complete version; refusing to overwrite"
            )
        folder = self._vpath(version)

        def _clean() -> None:
            invalidate(self.fs, folder)
            if self.fs.exists(folder):
                self.fs.rm(folder, recursive=True)
                invalidate(self.fs, folder)

        self._retry(_clean, f"clean partial {self.version_url(version)}")

    def drop_files(self, version: int, names: list[str]) -> int:
        """Take ``names`` out of the complete ``version``: its manifest is rewritten without them
        (atomically, its other entries and meta unchanged, the names added to ``meta["dropped"]``),
        then the files are deleted. Names the version does not hold are skipped. Returns the bytes
        freed (by the manifest's sizes)."""
        manifest, drop = self.read_manifest(version), set(names)
        gone = [e for e in manifest["files"] if e["path"] in drop]
        if not gone:
            return 0
        kept = [e for e in manifest["files"] if e["path"] not in drop]
        meta = {
            **manifest["meta"],
            "dropped": sorted({*manifest["meta"].get("dropped", []), *(e["path"] for e in gone)}),
        }
        data = (json.dumps({**manifest, "files": kept, "meta": meta}, indent=2, sort_keys=True) + "\n").encode()
        path = self._vpath(version, MANIFEST)
        self._retry(lambda: pipe_atomic(self.fs, path, data), f"rewrite manifest of {self.version_url(version)}")
        for entry in gone:
            self._delete_file(
                self._vpath(version, entry["path"]), f"delete {entry['path']} of {self.version_url(version)}"
            )
        return sum(e["size"] for e in gone)

    def _delete_file(self, path: str, what: str) -> None:
        """Delete one object if it is there (retried)."""

        def _rm() -> None:
            invalidate(self.fs, path)
            if self.fs.exists(path):
                self.fs.rm_file(path)

        self._retry(_rm, what)

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the ``keep_last`` newest complete versions (never the latest),
        and never the full version a kept delta version is made against.

        Each version's manifest is deleted first, then its files, then its
        materialised full copy if any. Returns the deleted versions. Partial
        (manifest-less) folders are left alone."""
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the latest version is never pruned)")
        versions = self.versions()
        kept = versions[-keep_last:]
        bases = {self.read_manifest(v)["meta"].get("base_version") for v in kept}
        doomed = [v for v in versions[:-keep_last] if v not in bases]
        for v in doomed:
            folder = self._vpath(v)

            def _rm_folder(folder=folder) -> None:
                invalidate(self.fs, folder)
                if self.fs.exists(folder):
                    self.fs.rm(folder, recursive=True)
                invalidate(self.fs, folder)

            self._delete_file(self._vpath(v, MANIFEST), f"delete manifest of {self.version_url(v)}")
            self._retry(_rm_folder, f"delete {self.version_url(v)}")
            for full in glob.glob(os.path.join(glob.escape(self._full_dir()), f"{self._url_key(v)}-full-*")):
                shutil.rmtree(full, ignore_errors=True)
        return doomed


def _makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
