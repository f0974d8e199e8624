"""Arithmetic that repeats (areal_core/numerics.py): MKL's mode in every process, order-fixed sums,
the CPU kind a run names, and the weight comparison a replay reports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from areal_core.numerics import (
    EMULATIONS,
    MKL_MODE,
    cpu_kind,
    emulation_env,
    fixed_sum,
    kind_label,
    mkl_mode,
    one_thread,
    onednn_avx512_bf16,
    onednn_bf16_units,
    require_repeatable,
    same_kernels,
)
from areal_core.run.replay import weight_difference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)


@pytest.mark.skipif(mkl_mode() is None, reason="this torch has no MKL")
def test_importing_areal_core_sets_mkls_mode_for_the_process_and_its_children():
    assert mkl_mode() == MKL_MODE  # this test process too
    r = _python(
        "import areal_core, os, subprocess, sys, torch\n"
        "from areal_core.numerics import mkl_mode\n"
        "a = torch.randn(64, 64); a @ a\n"
        "print(mkl_mode(), os.environ['MKL_CBWR'])\n"
        # a child that never imports areal_core inherits the mode
        "code = 'import ctypes, os, torch; a = torch.randn(8, 8); a @ a; "
        "from areal_core.numerics import mkl_mode; print(mkl_mode())'\n"
        "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout.strip())\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["AUTO,STRICT", "AUTO,STRICT", "AUTO,STRICT"]


@pytest.mark.skipif(mkl_mode() is None, reason="this torch has no MKL")
def test_a_process_whose_mkl_ran_before_areal_core_is_refused_with_what_to_do():
    r = _python(
        "import torch\na = torch.randn(64, 64); a @ a\n"
        "from areal_core.numerics import require_repeatable\nrequire_repeatable()\n"
    )
    assert r.returncode == 1
    assert "NotRepeatable: MKL runs in reproducibility mode 'OFF'" in r.stderr
    assert "Set MKL_CBWR=AUTO,STRICT" in r.stderr
    # a user's own mode with STRICT is kept; one without is refused the same way
    ok = _python(
        "import areal_core\nfrom areal_core.numerics import require_repeatable\nprint(require_repeatable())",
        MKL_CBWR="COMPATIBLE,STRICT",
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "COMPATIBLE,STRICT", ok.stderr
    bad = _python(
        "import areal_core\nfrom areal_core.numerics import require_repeatable\nrequire_repeatable()", MKL_CBWR="AUTO"
    )
    assert bad.returncode == 1 and "mode 'AUTO'" in bad.stderr


@pytest.mark.parametrize("n", [1, 5, 32_766, 32_767, 32_768, 100_003, 2_500_000])
def test_fixed_sum_is_the_sum_and_does_not_follow_the_thread_count(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(8) * 1e3  # widely varying magnitudes
    exact = math.fsum(x.double().tolist())  # an independent reference
    before = torch.get_num_threads()
    try:
        sums = []
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            sums.append(fixed_sum(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(sums[0], s) for s in sums[1:])
    scale = math.fsum(abs(v) for v in x.double().tolist())
    assert abs(float(sums[0]) - exact) <= 1e-6 * scale
    assert sums[0].dtype == x.dtype and sums[0].shape == ()


def test_a_plain_sum_does_follow_the_thread_count_here_which_is_why_fixed_sum_exists():
    """The reason for fixed_sum, checked where it shows: torch adds one partial sum per thread past
    32,768 elements. (Skipped where this build happens to agree on every count tried.)"""
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        sums = set()
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            sums.add(float(x.sum()))
    finally:
        torch.set_num_threads(before)
    if len(sums) == 1:
        pytest.skip("this build's plain sum gave one value on 1-4 threads")
    assert len(sums) > 1


def test_fixed_sum_passes_gradients_as_a_sum_does():
    x = torch.randn(40_000, requires_grad=True)
    fixed_sum(x * 3.0).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_cpu_kind_names_the_kernels_and_same_kernels_compares_them():
    k = cpu_kind()
    assert k["aten_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "SVE256", "NO AVX")
    assert k["torch"] == torch.__version__ and k["machine"]
    assert same_kernels(k, dict(k))
    assert not same_kernels(k, {**k, "aten_capability": "OTHER"})
    assert not same_kernels(k, {**k, "isa": [*k["isa"], "amx_bf16"]})
    assert same_kernels(k, {**k, "mkl_mode": "OTHER", "cpu": "another name"})  # neither picks kernels
    assert k["torch"] in kind_label(k) and k["aten_capability"] in kind_label(k)


def test_weight_difference_against_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    orig = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "c": torch.zeros(2)}
    same = weight_difference({k: v.clone() for k, v in orig.items()}, orig)
    assert same == {
        "first_tensor": None,
        "tensors_differing": 0,
        "tensors": 3,
        "max_abs": 0.0,
        "max_rel": 0.0,
        "relative_l2": 0.0,
    }
    rep = {k: v.clone() for k, v in orig.items()}
    rep["b"][2] += 1e-3
    rep["c"][0] = 5e-4  # a change where the original is 0: absolute, not relative
    d = weight_difference(rep, orig)
    assert d["first_tensor"] == "b" and d["tensors_differing"] == 2
    assert d["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    assert d["max_rel"] == pytest.approx(1e-3 / abs(float(orig["b"][2])), rel=1e-3)
    total = sum(float((v.double() ** 2).sum()) for v in orig.values())
    diff = 1e-3**2 + 5e-4**2
    assert d["relative_l2"] == pytest.approx(math.sqrt(diff / total), rel=1e-3)
    with pytest.raises(ValueError, match="other tensors"):
        weight_difference({"a": orig["a"]}, orig)


def test_require_repeatable_in_this_process():
    assert require_repeatable() in (None, MKL_MODE)


@pytest.mark.parametrize(
    "flags, cap, avx512",
    [
        ({"avx2"}, "ALL", False),  # an AVX2-only CPU: no AVX-512 kernels
        ({"avx2", "avx512f"}, "ALL", True),  # AVX-512 without bf16 units
        ({"avx2", "avx512f", "avx512_bf16"}, "ALL", True),  # AVX-512 BF16 (EPYC)
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "ALL", True),  # AMX (Xeon)
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE", True),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_core_vnni", True),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", False),  # capped below AVX-512
        ({"avx2", "avx512f", "avx512_bf16"}, "avx2_vnni_2", False),
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX", True),
    ],
)
def test_onednn_runs_avx512_bf16_kernels_where_the_cpu_and_the_cap_allow(flags, cap, avx512):
    assert onednn_avx512_bf16(flags, cap) is avx512


@pytest.mark.parametrize(
    "flags, cap, units",
    [
        ({"avx2"}, "ALL", []),  # the AVX2-only EPYC
        ({"avx2", "avx512f"}, "ALL", []),  # AVX-512 without bf16 units
        ({"avx2", "avx512f", "avx512_bf16"}, "ALL", ["avx512_bf16"]),  # the EPYC with AVX-512 BF16
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "ALL", ["amx_bf16", "avx512_bf16"]),  # the AMX Xeon
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", ["avx512_bf16"]),  # its EPYC emulation
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX2", []),  # its AVX2 emulation
        ({"avx2", "avx512f", "avx512_bf16"}, "avx2", []),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE_VNNI", []),  # below the bf16 kernels
    ],
)
def test_bf16_units_count_where_the_cpu_has_them_and_the_cap_allows(flags, cap, units):
    assert onednn_bf16_units(flags, cap) == units


def test_one_thread_fixes_the_bits_of_an_elementwise_op_whatever_the_thread_count():
    """SiLU over 2,173,377 elements: where the threads' slices end its scalar tail code rounds
    otherwise than its vector code on some CPUs (an Intel Xeon with AMX: 1-3 elements on 3 and 4
    threads), so under ``one_thread`` every thread count gives the one-thread bits, and the thread
    count is back afterwards."""
    x = torch.randn(2_173_377, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.nn.functional.silu(x)
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            with one_thread():
                assert torch.get_num_threads() == 1
                assert torch.equal(torch.nn.functional.silu(x), alone)
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_emulation_env_puts_one_kinds_kernel_caps_in_place_of_the_callers():
    environ = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert emulation_env(None, environ) == {"PATH": "/bin"}  # this CPU's own kernels
    if "avx512_bf16" in cpu_kind()["isa"]:
        assert emulation_env("avx512-bf16", environ) == {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    env = emulation_env("avx2", environ)
    assert env == {"PATH": "/bin", **EMULATIONS["avx2"][1]} and environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    with pytest.raises(ValueError, match="no emulation named 'avx1'"):
        emulation_env("avx1", environ)


def test_an_emulation_needs_the_instructions_of_the_kind_it_emulates(monkeypatch):
    import areal_core.numerics as numerics

    monkeypatch.setattr(numerics, "_cpu_flags", lambda: ["sse4_2", "avx2"])
    assert emulation_env("avx2", {})["ATEN_CPU_CAPABILITY"] == "avx2"
    with pytest.raises(ValueError, match="cannot emulate 'avx512-bf16' here: this CPU has no avx512_bf16"):
        emulation_env("avx512-bf16", {})


def _kind_under(env: dict) -> dict:
    code = "import json; from areal_core.numerics import cpu_kind; print(json.dumps(cpu_kind()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif("avx512f" not in cpu_kind()["isa"], reason="nothing above AVX2 to lower here")
def test_a_process_under_an_emulation_computes_with_and_names_the_lower_kernels():
    kind, native = _kind_under(emulation_env("avx2", os.environ)), _kind_under(emulation_env(None, os.environ))
    assert (kind["aten_capability"], kind["onednn_max_isa"], kind["mkl_max_isa"]) == ("AVX2", "AVX2", "AVX2")
    assert (native["onednn_max_isa"], native["mkl_max_isa"]) == ("default", "default")
    assert kind["isa"] == native["isa"]  # the CPU's own flags: the record says what was lowered, not what it had
    assert "kernels AVX2, oneDNN <= AVX2, MKL <= AVX2" in kind_label(kind)
    assert not same_kernels(kind, native)
    assert not same_kernels({**native, "mkl_max_isa": "AVX2"}, native)  # MKL's cap alone picks other kernels


def test_a_record_from_before_the_mkl_cap_was_named_has_the_default_cap():
    here = cpu_kind()
    old = {k: v for k, v in here.items() if k != "mkl_max_isa"}
    assert same_kernels(old, {**here, "mkl_max_isa": "default"})
    assert not same_kernels(old, {**here, "mkl_max_isa": "AVX2"})
