"""The LoRA checkpoint format: a version's weights as adapters over checkpoint v0.

A LoRA run (``trainer.lora``) keeps its base frozen, so every checkpoint after v0 holds only
``adapter.safetensors`` (each adapted module's ``lora_A`` and unscaled ``lora_B``, float32) and
``adapter_config.json`` (rank, alpha, targets, modules, ``base_version: 0``), beside the config,
tokenizer and run state; its manifest's meta says ``format: lora`` and ``base_version: 0``.
``CheckpointStore.local_copy`` turns such a version into a full HF folder with :func:`materialise`
(merged by :func:`merge_state`, the merge the rollout engine uses), so readers never see adapters.

The adapters' arithmetic lives here too, below everything that uses it: :func:`merge_weight` is the
only place a merged weight is computed (``trainer/lora.py`` says why that matters).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from areal_core.storage.delta import build_folder
from areal_core.storage.snapshot import WEIGHTS

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
ADAPTER_FILE = "adapter.safetensors"  # a LoRA checkpoint's weights: unscaled lora_A / lora_B by module
ADAPTER_CONFIG = "adapter_config.json"  # rank, alpha, targets, modules, base_version
CONFIG_FORMAT = "areal-lora/1"
BASE_VERSION = 0  # every LoRA checkpoint is made against the run's checkpoint v0


def scale_of(rank: int, alpha: float) -> float:
    return float(alpha) / int(rank)


def scaled_b(b: torch.Tensor, scale: float) -> torch.Tensor:
    """``lora_B * alpha / r`` in float32: the B that travels and that :func:`merge_weight` takes."""
    return b.to(torch.float32) * scale


def merge_weight(base: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor) -> torch.Tensor:
    """THE merge: ``(float32(base) + b_scaled @ a)`` rounded to ``base``'s dtype. One product, then
    one add (no fused add-multiply), so every caller gets the same bits on one machine.

    A bfloat16 base keeps the caveat of any merged bf16 weight: a delta smaller than half a bf16
    step of the base value rounds away (the adapters themselves stay exact in float32)."""
    delta = torch.mm(
        b_scaled.to(device=base.device, dtype=torch.float32), a.to(device=base.device, dtype=torch.float32)
    )
    return (base.to(torch.float32) + delta).to(base.dtype)


def merge_state(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], config: dict, source: str
) -> dict[str, torch.Tensor]:
    """``base`` (checkpoint v0's tensors by name) with the checkpoint's adapters (unscaled, as
    :func:`adapter_tensors` saved them, ``config`` their ``adapter_config.json``) merged in."""
    if config.get("format") != CONFIG_FORMAT:
        raise ValueError(f"{source}: {ADAPTER_CONFIG} has format {config.get('format')!r}, expected {CONFIG_FORMAT!r}")
    scale = scale_of(config["rank"], config["alpha"])
    out = dict(base)
    for mod, (a, b) in adapter_pairs(adapters, source).items():
        w = base.get(mod + ".weight")
        if w is None:
            raise ValueError(f"{source}: adapter of {mod}, but the base has no {mod}.weight")
        _check_pair(mod, a, b, tuple(w.shape), source)
        out[mod + ".weight"] = merge_weight(w, a, scaled_b(b, scale))
    return out


def is_adapter_name(name: str) -> bool:
    return name.endswith((A_SUFFIX, B_SUFFIX))


def adapter_pairs(named: dict[str, torch.Tensor], source: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (lora_A, lora_B)}`` from tensors named ``<module>.lora_A`` / ``.lora_B``; every
    name must be one, and every module must have both."""
    halves: dict[str, list] = {}
    for name, t in named.items():
        if not is_adapter_name(name):
            raise ValueError(
                f"{source}: {name!r} is not an adapter tensor (<module>.lora_A or .lora_B); an "
                "update holds adapters only or full weights only"
            )
        mod, which = (name[: -len(A_SUFFIX)], 0) if name.endswith(A_SUFFIX) else (name[: -len(B_SUFFIX)], 1)
        halves.setdefault(mod, [None, None])[which] = t
    for mod, (a, b) in halves.items():
        if a is None or b is None:
            raise ValueError(
                f"{source}: {mod} has {'lora_B' if a is None else 'lora_A'} without "
                f"{'lora_A' if a is None else 'lora_B'}"
            )
    return {m: (a, b) for m, (a, b) in halves.items()}


def _check_pair(mod: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], source: str) -> None:
    out_f, in_f = shape
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"{source}: the adapters of {mod} are {a.dtype}/{b.dtype}; adapters are float32")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{source}: {mod}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its "
            f"weight {shape} (expected [r, {in_f}] and [{out_f}, r])"
        )


FORMAT = "lora"


def write_adapters(tensors: dict[str, torch.Tensor], config: dict, folder: str) -> str:
    """``adapter.safetensors`` and ``adapter_config.json`` into ``folder``; returns the weights' path."""
    path = os.path.join(folder, ADAPTER_FILE)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path, metadata={"format": "pt"})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return path


def read_adapters(folder: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(adapters, adapter config) of a LoRA version's folder."""
    for name in (ADAPTER_FILE, ADAPTER_CONFIG):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(f"{folder}: a LoRA checkpoint without {name}")
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    return load_file(os.path.join(folder, ADAPTER_FILE)), config


def materialise(raw_folder: str, base_folder: str, dest: str) -> str:
    """Build at ``dest`` a full HF folder: the LoRA version's files (but its adapters and manifest)
    and ``model.safetensors`` = the base's weights with the adapters merged. Whole or absent."""
    if os.path.isdir(dest):
        return dest
    base_weights = os.path.join(base_folder, WEIGHTS)
    if not os.path.isfile(base_weights):
        raise FileNotFoundError(f"{base_folder}: the LoRA checkpoint's base has no {WEIGHTS}")
    adapters, config = read_adapters(raw_folder)
    tensors = merge_state(load_file(base_weights), adapters, config, f"{raw_folder}/{ADAPTER_FILE}")
    return build_folder(raw_folder, dest, tensors, skip=(ADAPTER_FILE, ADAPTER_CONFIG))
