"""``model.dtype: auto``: bfloat16 where the CPU has bf16 matrix units, float32 elsewhere; the tiny model
always float32; an explicit dtype wins."""

from __future__ import annotations

import pytest
import torch

from areal_core import device
from areal_core.models.config import ModelConfig
from areal_core.models.loading import model_dtype


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Point the flag reader at a fake /proc/cpuinfo holding the given flags."""

    def with_flags(flags: str):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
        real_open = open
        monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(path if p == "/proc/cpuinfo" else p, *a, **k))
        device.cpu_bf16_units.cache_clear()

    yield with_flags
    device.cpu_bf16_units.cache_clear()


@pytest.mark.parametrize(
    "flags,want,units",
    [
        ("avx512f avx512_bf16 amx_bf16 amx_tile", torch.bfloat16, "amx_bf16+avx512_bf16"),
        ("avx512f avx512_bf16", torch.bfloat16, "avx512_bf16"),
        ("fma", torch.float32, None),
    ],
)
def test_auto_follows_the_cpus_bf16_units(cpuinfo, flags, want, units):
    cpuinfo(flags)
    assert device.cpu_bf16_units() == units
    dtype, why = device.resolve_dtype("auto", torch.device("cpu"))
    assert dtype == want
    assert (units or "no bfloat16 matrix units") in why


def test_explicit_dtype_and_the_tiny_model(cpuinfo):
    cpuinfo("amx_bf16 avx512_bf16")
    assert device.resolve_dtype("float32", torch.device("cpu"))[0] == torch.float32
    assert model_dtype(ModelConfig(name="smollm2-135m", device="cpu"))[0] == torch.bfloat16
    assert model_dtype(ModelConfig(name="smollm2-135m", device="cpu", dtype="float32"))[0] == torch.float32
    assert model_dtype(ModelConfig(name="tiny", device="cpu"))[0] == torch.float32
    with pytest.raises(ValueError, match=r"model.dtype must be auto, float32 or bfloat16"):
        device.resolve_dtype("float16", torch.device("cpu"))
