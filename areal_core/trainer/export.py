"""Export a checkpoint as a plain Hugging Face model folder (``areal-flow export``).

    export_checkpoint("runs/x/checkpoints/v40", "out/model")   # one version
    export_checkpoint("runs/x", "out/model")                   # a run: its latest complete version

The folder holds ``model.safetensors`` (full weights: a delta version rebuilt, a LoRA version's
adapters merged into v0 by the same merge the rollout engine uses), ``config.json``,
``generation_config.json`` and the tokenizer files, and nothing of the run (no manifest, resume
state or adapters), so ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it.
It is built in a temporary folder beside the destination and renamed into place: the destination
is whole or absent.

A LoRA version can also go out as its adapters in PEFT's format (:func:`export_peft`): ``base/``
(checkpoint v0, the model the adapters were made against) and ``adapter/``
(``adapter_config.json`` + ``adapter_model.safetensors``), which
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("OUT/base"), "OUT/adapter")``
loads; its outputs are the merged export's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from areal_core.storage import CheckpointStore
from areal_core.storage.adapters import A_SUFFIX, ADAPTER_CONFIG, ADAPTER_FILE, B_SUFFIX, BASE_VERSION
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


@contextlib.contextmanager
def _staged_into(out: str):
    """``(tmp, staged)``: a scratch folder beside ``out`` and the path to write the export at inside
    it, which becomes ``out`` (absolute; it must not exist or be empty) once the block ends without an
    error; nothing is left at ``out`` otherwise."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"{out} already exists and is not an empty folder; give a new or empty folder as --out")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(out)}.partial-") as tmp:
        staged = os.path.join(tmp, "out")
        yield tmp, staged
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(staged, out)


def export_checkpoint(source: str, out: str) -> str:
    """Write checkpoint ``source`` (a version, or a run folder's latest) as a full HF folder at
    ``out``, which must not exist or be empty; returns ``out``."""
    out = os.path.abspath(out)
    with _staged_into(out) as (tmp, staged):
        store, version = _store_and_version(source, os.path.join(tmp, "cache"))
        try:
            folder = store.local_copy(version)
        except VersionNotFoundError as e:
            raise ExportError(str(e)) from None
        if not os.path.isfile(os.path.join(folder, WEIGHTS)):
            raise ExportError(f"{store.version_url(version)}: no {WEIGHTS} after materialising; not a model checkpoint")
        for dirpath, _, names in os.walk(folder):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
                if rel in _LEFT_OUT or rel.startswith("resume/"):
                    continue
                dest = os.path.join(staged, *rel.split("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copyfile(os.path.join(dirpath, name), dest)
    return out


def peft_tensors(adapters: dict, prefix: str = "base_model.model.") -> dict:
    """Our adapters (``<module>.lora_A`` / unscaled ``.lora_B``) under PEFT's names
    (``base_model.model.<module>.lora_A.weight``; PEFT scales B by alpha / r, as we do)."""
    out = {}
    for name, t in adapters.items():
        for suffix in (A_SUFFIX, B_SUFFIX):
            if name.endswith(suffix):
                out[f"{prefix}{name[: -len(suffix)]}{suffix}.weight"] = t.contiguous()
    if len(out) != len(adapters):
        raise ExportError(f"adapters with names PEFT has no place for: {sorted(set(adapters))[:3]}")
    return out


def peft_config(config: dict) -> dict:
    """PEFT's ``adapter_config.json`` for our ``adapter_config.json``: rank, alpha and the target
    modules' names; no dropout, no bias (what the trainer's adapters are)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(config["rank"]),
        "lora_alpha": float(config["alpha"]),
        "target_modules": sorted(config["targets"]),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": "../base",
    }


def export_peft(source: str, out: str) -> str:
    """Write LoRA checkpoint ``source`` (a version, or a run folder's latest) as ``out/base`` (the
    base model, v0) and ``out/adapter`` (its adapters in PEFT's format); ``out`` must not exist or be
    empty; returns ``out``. A version of full weights has no adapters: an :class:`ExportError`."""
    out = os.path.abspath(out)
    with _staged_into(out) as (tmp, staged):
        store, version = _store_and_version(source, os.path.join(tmp, "cache"))
        try:
            adapters = load_safetensors(store.read_file(version, ADAPTER_FILE))
            config = json.loads(store.read_file(version, ADAPTER_CONFIG))
        except FileNotFoundError:
            raise ExportError(
                f"{store.version_url(version)} holds full weights, not adapters (a run without trainer.lora): "
                "export it without --peft"
            ) from None
        export_checkpoint(store.version_url(BASE_VERSION), os.path.join(staged, "base"))
        adapter = os.path.join(staged, "adapter")
        os.makedirs(adapter)
        save_file(peft_tensors(adapters), os.path.join(adapter, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
            json.dump(peft_config(config), f, indent=2, sort_keys=True)
    return out
