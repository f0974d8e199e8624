"""A consistent CPU snapshot of a Hugging Face model, in the layout ``save_pretrained`` writes.

``snapshot_model`` runs on the training thread, between optimizer steps: it clones
every weight to CPU (so training may go on mutating the live weights) and renders
the small files (config.json, generation_config.json, tokenizer files) as bytes.
``CheckpointWriter`` then writes them in the background.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
SAFETENSORS_META = {"format": "pt"}  # what save_pretrained writes


def _tied_targets(model: Any) -> set[str]:
    """Names that save_pretrained leaves out because they alias another tensor (e.g. a tied lm_head)."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(tied)  # a dict {target: source} (transformers 5) or a list of targets


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t``. CPU tensors are copied as bytes by numpy: a plain
    memcpy, not an intra-op parallel torch copy, whose thread pool stalls for tens of
    ms when the cores are busy (measured: 2 MB in 120 ms with 2 threads, 1.4 ms with 1)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()  # a new tensor already
    if not t.is_contiguous():
        return t.contiguous()  # a new tensor already
    raw = t.reshape(-1).view(torch.uint8).numpy().copy()
    return torch.from_numpy(raw).view(t.dtype).reshape(t.shape)


@torch.no_grad()
def snapshot_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU clones of the model's state dict, one entry per storage.

    A tensor that shares its storage with one already taken is left out, preferring to
    leave out the tied names (``lm_head.weight`` of a tied model), as save_pretrained does."""
    state = model.state_dict()
    targets = _tied_targets(model)
    order = sorted(state, key=lambda n: n in targets)  # tied targets last: their source is kept
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name in order:
        t = state[name]
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = cpu_copy(t)
    return {n: out[n] for n in state if n in out}  # the state dict's order


def snapshot_files(model: Any, tokenizer: Any = None) -> dict[str, bytes]:
    """config.json, generation_config.json (if the model generates) and the tokenizer files, as bytes."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]  # save_pretrained records the class
    with tempfile.TemporaryDirectory(prefix="areal-snapshot-") as tmp:
        config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and model.can_generate():
            gen.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, tmp).replace(os.sep, "/")] = f.read()
    return files


def snapshot_model(model: Any, tokenizer: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """(tensors, files) for ``CheckpointWriter.submit``: a consistent copy the caller may forget."""
    return snapshot_tensors(model), snapshot_files(model, tokenizer)


def write_weights(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write ``tensors`` as one safetensors file, as save_pretrained does (same names, metadata)."""
    save_file(tensors, path, metadata=SAFETENSORS_META)
