"""``device: auto | cpu | cuda`` for the embedded engine and the torch trainer."""

from __future__ import annotations

from typing import Literal

import torch

DeviceName = Literal["auto", "cpu", "cuda"]


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU. ``cuda`` without one is an error that
    says why (a CPU build of torch, or no visible GPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible (CUDA_VISIBLE_DEVICES?)"
        raise ValueError(f"device: cuda was asked for, but torch {torch.__version__} cannot use CUDA here: {why}")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)
