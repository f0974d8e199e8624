"""``model.dtype: auto`` on a CPU: the trainer in float32, the rollout servers in bfloat16 where the CPU
has bf16 matrix units (float32 elsewhere); the tiny model always float32; an explicit dtype wins, for
both."""

from __future__ import annotations

import pytest
import torch

from areal_core import device
from areal_core.models.config import ModelConfig
from areal_core.models.loading import model_dtype, servers_model_dtype


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Point the flag reader at a fake /proc/cpuinfo holding the given flags."""

    def with_flags(flags: str):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
        real_open = open
        monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(path if p == "/proc/cpuinfo" else p, *a, **k))
        for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # oneDNN uncapped unless a test caps it
            monkeypatch.delenv(cap, raising=False)
        device.cpu_bf16_units.cache_clear()

    yield with_flags
    device.cpu_bf16_units.cache_clear()


@pytest.mark.parametrize(
    "flags,servers,units",
    [
        ("avx512f avx512_bf16 amx_bf16 amx_tile", torch.bfloat16, "amx_bf16+avx512_bf16"),
        ("avx512f avx512_bf16", torch.bfloat16, "avx512_bf16"),
        ("fma", torch.float32, None),
    ],
)
def test_auto_gives_the_cpus_bf16_units_to_the_servers(cpuinfo, flags, servers, units):
    cpuinfo(flags)
    cpu = torch.device("cpu")
    assert device.cpu_bf16_units() == units
    dtype, why = device.resolve_dtype("auto", cpu)
    assert dtype == torch.float32 and (units or "no bfloat16 matrix units") in why
    dtype, why = device.resolve_servers_dtype("auto", cpu)
    assert dtype == servers and (units or "no bfloat16 matrix units") in why


@pytest.mark.parametrize(
    "cap,units,servers",
    [
        ("AVX2", None, torch.float32),  # the emulation of an AVX2-only CPU: no bf16 units, as there
        ("AVX512_CORE_BF16", "avx512_bf16", torch.bfloat16),  # the emulation of the AVX-512 BF16 EPYC
        ("AVX512_CORE_AMX", "amx_bf16+avx512_bf16", torch.bfloat16),
    ],
)
def test_units_that_onednn_is_capped_below_do_not_count(cpuinfo, monkeypatch, cap, units, servers):
    cpuinfo("avx512f avx512_bf16 amx_bf16 amx_tile")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert device.cpu_bf16_units() == units
    assert device.resolve_servers_dtype("auto", torch.device("cpu"))[0] == servers


def test_explicit_dtype_and_the_tiny_model(cpuinfo):
    cpuinfo("amx_bf16 avx512_bf16")
    assert device.resolve_dtype("float32", torch.device("cpu"))[0] == torch.float32
    smollm2 = ModelConfig(name="smollm2-135m", device="cpu")
    assert (model_dtype(smollm2)[0], servers_model_dtype(smollm2)[0]) == (torch.float32, torch.bfloat16)
    for set_ in ("float32", "bfloat16"):
        m = ModelConfig(name="smollm2-135m", device="cpu", dtype=set_)
        assert model_dtype(m)[0] == servers_model_dtype(m)[0] == getattr(torch, set_)
    tiny = ModelConfig(name="tiny", device="cpu", dtype="bfloat16")
    assert model_dtype(tiny)[0] == servers_model_dtype(tiny)[0] == torch.float32
    for resolve in (device.resolve_dtype, device.resolve_servers_dtype):
        with pytest.raises(ValueError, match=r"model.dtype must be auto, float32 or bfloat16"):
            resolve("float16", torch.device("cpu"))


def test_rollout_dtype_model_follows_what_model_dtype_gives_the_servers(cpuinfo):
    from areal_core.experiment import parse_config

    cpuinfo("avx512_bf16")
    cfg = parse_config({"model": {"name": "smollm2-135m", "device": "cpu"}}, source="test")
    given = str(servers_model_dtype(cfg.model)[0]).removeprefix("torch.")
    assert cfg.rollout.engine_config(seed=0, dtype=given).dtype == "bfloat16"
    cfg = parse_config(
        {"model": {"name": "smollm2-135m", "device": "cpu"}, "rollout": {"dtype": "float32"}}, source="t"
    )
    assert cfg.rollout.engine_config(seed=0, dtype=given).dtype == "float32"
