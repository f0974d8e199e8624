"""Export a checkpoint as a plain Hugging Face model folder (``areal-flow export``).

    export_checkpoint("runs/x/checkpoints/v40", "out/model")   # one version
    export_checkpoint("runs/x", "out/model")                   # a run: its latest complete version

The folder holds ``model.safetensors`` (full weights: a delta version rebuilt, a LoRA version's
adapters merged into v0 by the same merge the rollout engine uses), ``config.json``,
``generation_config.json`` and the tokenizer files, and nothing of the run (no manifest, resume
state or adapters), so ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it.
It is built in a temporary folder beside the destination and renamed into place: the destination
is whole or absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from areal_core.storage import CheckpointStore
from areal_core.storage.adapters import ADAPTER_CONFIG, ADAPTER_FILE
from areal_core.storage.checkpoints import VersionNotFoundError
from areal_core.storage.delta import DELTA
from areal_core.storage.manifest import MANIFEST
from areal_core.storage.snapshot import WEIGHTS

_VERSION_URL = re.compile(r"^(.+?)/v(\d+)/?$")
_LEFT_OUT = {MANIFEST, ADAPTER_FILE, ADAPTER_CONFIG, DELTA}  # and the run state under resume/


class ExportError(ValueError):
    """The source or the destination of an export is not usable; the message says why."""


def _store_and_version(source: str, cache_dir: str) -> tuple[CheckpointStore, int]:
    """The store and version ``source`` names: ``.../v<N>``, or a run folder (its latest version)."""
    m = _VERSION_URL.match(source.rstrip("/") + "/")
    if m is not None and ("://" in source or os.path.isfile(os.path.join(source, MANIFEST))):
        return CheckpointStore(m.group(1), cache_dir=cache_dir), int(m.group(2))
    if "://" in source or not os.path.isdir(source):
        raise ExportError(
            f"{source}: give a checkpoint version (RUN/checkpoints/vN, a folder or URL with "
            f"a {MANIFEST}) or a run folder"
        )
    url = os.path.join(source, "checkpoints")
    config = os.path.join(source, "config.json")
    if os.path.isfile(config):  # a run folder: its checkpoints may live elsewhere (storage.url)
        with open(config) as f:
            run = json.load(f)
        url = ((run.get("storage") or {}).get("url") if isinstance(run, dict) else None) or url
    store = CheckpointStore(url, cache_dir=cache_dir)
    latest = store.latest()
    if latest is None:
        raise ExportError(
            f"{source}: no complete checkpoint in {store.url} (give a run folder or a "
            f"checkpoint version RUN/checkpoints/vN)"
        )
    return store, latest


def export_checkpoint(source: str, out: str) -> str:
    """Write checkpoint ``source`` (a version, or a run folder's latest) as a full HF folder at
    ``out``, which must not exist or be empty; returns ``out``."""
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"{out} already exists and is not an empty folder; give a new or empty folder as --out")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(out)}.partial-") as tmp:
        store, version = _store_and_version(source, os.path.join(tmp, "cache"))
        try:
            folder = store.local_copy(version)
        except VersionNotFoundError as e:
            raise ExportError(str(e)) from None
        if not os.path.isfile(os.path.join(folder, WEIGHTS)):
            raise ExportError(f"{store.version_url(version)}: no {WEIGHTS} after materialising; not a model checkpoint")
        staged = os.path.join(tmp, "model")
        for dirpath, _, names in os.walk(folder):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
                if rel in _LEFT_OUT or rel.startswith("resume/"):
                    continue
                dest = os.path.join(staged, *rel.split("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copyfile(os.path.join(dirpath, name), dest)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(staged, out)
    return out
