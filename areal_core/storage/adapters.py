"""The LoRA checkpoint format: a version's weights as adapters over checkpoint v0.

A LoRA run (``trainer.lora``) keeps its base frozen, so every checkpoint after v0 holds only
``adapter.safetensors`` (each adapted module's ``lora_A`` and unscaled ``lora_B``, float32) and
``adapter_config.json`` (rank, alpha, targets, modules, ``base_version: 0``), beside the config,
tokenizer and run state; its manifest's meta says ``format: lora`` and ``base_version: 0``.
``CheckpointStore.local_copy`` turns such a version into a full HF folder with :func:`materialise`
(merged by ``lora.merge_state``, the merge the rollout engine uses), so readers never see adapters.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from areal_core.storage.delta import build_folder
from areal_core.storage.snapshot import WEIGHTS
from areal_core.trainer.lora import ADAPTER_CONFIG, ADAPTER_FILE, merge_state

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
