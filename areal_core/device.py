"""``device: auto | cpu | cuda`` and ``dtype: auto | float32 | bfloat16`` for the embedded engine and
the torch trainer."""

from __future__ import annotations

import functools
from typing import Literal

import torch

from areal_core.numerics import onednn_bf16_units

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


@functools.cache
def cpu_bf16_units() -> str | None:
    """The CPU's bfloat16 matrix units as named in /proc/cpuinfo (``amx_bf16``, ``avx512_bf16``) that
    oneDNN may use (``numerics.onednn_bf16_units``: a kind's emulation caps the others away), or None
    where there are none (e.g. an AVX2-only CPU) or the flags cannot be read."""
    return "+".join(onednn_bf16_units()) or None


_NO_BF16_UNITS = "auto: this CPU has no bfloat16 matrix units, neither AMX nor AVX-512 BF16"


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` the trainer computes in for ``model.dtype``. ``auto``: bfloat16 on a GPU that
    supports it; float32 on a CPU. A CPU's bfloat16 units (AMX or AVX-512 BF16) serve the rollout
    servers instead (``resolve_servers_dtype``): on both kinds of such CPU measured (AVX-512 BF16,
    AMX) a bfloat16 trainer (float32 masters) learned less than a float32 one, and a float32 trainer
    beside bfloat16 servers as much (``python -m bench dtype_control``, docs/RESULTS.md). The trainer
    keeps float32 master weights and optimizer state either way (trainer/trainer.py)."""
    if name in ("float32", "bfloat16"):
        return getattr(torch, name), "set in the config (model.dtype)"
    if name != "auto":
        raise ValueError(f"model.dtype must be auto, float32 or bfloat16, got {name!r}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: {torch.cuda.get_device_name(device)} supports bfloat16"
        return torch.float32, f"auto: {torch.cuda.get_device_name(device)} lacks bfloat16"
    units = cpu_bf16_units()
    if units:
        return (
            torch.float32,
            f"auto: float32 for the trainer on a CPU (its bfloat16 units, {units}, serve the rollout servers)",
        )
    return torch.float32, _NO_BF16_UNITS


def resolve_servers_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` the rollout servers compute in under ``model.dtype`` (``rollout.dtype:
    model``). ``auto``: bfloat16 where the device has bfloat16 matrix work (a GPU that supports it; a
    CPU with AMX or AVX-512 BF16, where it is several times faster than float32), else float32 (on an
    AVX2-only CPU bfloat16 is emulated and slower)."""
    if name != "auto" or device.type == "cuda":
        return resolve_dtype(name, device)
    units = cpu_bf16_units()
    if units:
        return torch.bfloat16, f"auto: this CPU has bfloat16 matrix units ({units})"
    return torch.float32, _NO_BF16_UNITS
