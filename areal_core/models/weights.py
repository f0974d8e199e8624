"""A decoder's weights and safetensors folders: which Hugging Face models the engine and the trainer
support, loading them, and reading and applying new weights from safetensors folders."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from areal_core.models.decoder import UnsupportedModelError, check_decoder  # noqa: F401 - the engine's
from areal_core.storage.localize import localize

check_supported = check_decoder  # the engine serves exactly the decoders the trainer trains


def eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The model's EOS ids, from its config and generation config."""
    ids: list[int] = []
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if e not in ids:
                ids.append(int(e))
    return ids


def load_model(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face causal LM from a local folder or fsspec URL, checked for support."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(localize(model_path), dtype=dtype).eval()
    check_supported(model)
    return model


# -- weights --------------------------------------------------------------------


def _ignored_key(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def read_weights(model: torch.nn.Module, folder: str) -> dict[str, torch.Tensor]:
    """Read and check the safetensors weights in ``folder`` against ``model``.

    Returns tensors keyed by the model's parameter names, converted to the
    model's dtypes, ready for :func:`apply_weights`. Nothing in the model is
    touched, so a bad folder leaves the running weights intact. A tied LM head
    takes the embedding's weights (its own tensor in the file, if any, is skipped).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder!r} does not exist")
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder!r}")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wanted = set(json.load(f)["weight_map"].values())
        files = [p for p in files if os.path.basename(p) in wanted]
    params = dict(model.named_parameters())  # tied parameters appear once
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in params]
    staged: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle: keys() but no __iter__
                if name in tied or _ignored_key(name):
                    continue
                if name not in params:
                    raise ValueError(f"{os.path.basename(path)}: tensor {name!r} does not belong to the model")
                t = f.get_tensor(name)
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} in the checkpoint, {tuple(p.shape)} in the model")
                staged[name] = t.to(p.dtype)
    missing = sorted(set(params) - set(staged))
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return staged


@torch.no_grad()
def apply_weights(model: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
    """Copy ``staged`` (from :func:`read_weights`) into ``model``'s parameters, in place.

    A :class:`~areal_core.rollout.backends.embedded.kv_forward.KVForward` over ``model`` keeps fused copies of
    some weights: call its ``weights_changed()`` afterwards.
    """
    params = dict(model.named_parameters())
    for name, t in staged.items():
        params[name].copy_(t)
