"""The trainer's and the engine's bits under every kernel family torch offers on this machine, on 1 to
4 threads, idle and beside a busy-loop load (tests/numerics_probe.py runs in a subprocess per family).

Where ``numerics.thread_invariant`` promises it (bfloat16 without AVX-512; float32 on an Intel CPU,
MKL's strict mode), the thread count changes no bit; everywhere, a computation repeats bit for bit on its own
thread count, loaded or not. Each family emulates another CPU kind's kernels: ATen's vector width
(``ATEN_CPU_CAPABILITY``), oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA``) and MKL's
(``MKL_ENABLE_INSTRUCTIONS``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.device import cpu_bf16_units

ROOT = Path(__file__).resolve().parents[2]

# the machine's own kernels, then what an AVX2-only CPU, an AVX-512 CPU without bf16 units and a CPU
# without vector units would run (each only where this CPU can run it)
FAMILIES = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512-no-bf16-units": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def _flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def probe(env: dict, threads: str = "1,2,3,4") -> dict:
    # passive OpenMP waits unless the caller set a policy: on a 2-core machine the 3- and 4-thread cases
    # otherwise spin against each other and the other test worker (the policy changes no arithmetic)
    e = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **env}
    e.pop("MKL_CBWR", None)  # what a fresh process gets: areal_core sets it
    r = subprocess.run(
        [sys.executable, "-m", "tests.numerics_probe", "--threads", threads],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_threads(out: dict) -> list[str]:
    """Cases whose digests differ between thread counts where the process promised they would not;
    prints what held where (the test's output names the kernels)."""
    wrong = []
    print(f"kernels: {out['kind']}")
    for key, by_threads in out["digests"].items():
        dtype = key.split("/")[1]
        invariant, why = out["thread_invariant"][dtype]
        same = len(set(by_threads.values())) == 1
        print(f"  {key}: {'one result on 1-4 threads' if same else by_threads} ({why})")
        if invariant and not same:
            wrong.append(key)
    return wrong


def _family_params():
    flags = _flags()
    for name, env in FAMILIES.items():
        marks = [] if name == "native" else [pytest.mark.nightly]
        if env.get("ATEN_CPU_CAPABILITY") == "avx512" and "avx512f" not in flags:
            marks.append(pytest.mark.skip(reason="this CPU has no AVX-512"))
        if env.get("ATEN_CPU_CAPABILITY") == "avx2" and "avx2" not in flags:
            marks.append(pytest.mark.skip(reason="this CPU has no AVX2"))
        yield pytest.param(env, id=name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("env", list(_family_params()))
def test_the_thread_count_changes_no_bit_where_promised(env):
    out = probe(env)
    assert out["mkl_mode"] in (None, "AUTO,STRICT")
    assert not check_threads(out)
    # bfloat16 is promised wherever oneDNN does not run AVX-512 kernels (computed here from the CPU's
    # flags and the family's cap, apart from the code's own rule)
    # (the family's cap, else the one this process runs under: bench test_suite emulates an AVX2 CPU so)
    flags, cap = _flags(), env.get("ONEDNN_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "")).upper()
    avx512 = "avx512f" in flags and cap not in ("AVX2", "AVX", "SSE41")
    assert out["thread_invariant"]["bfloat16"][0] == (not avx512), out["thread_invariant"]["bfloat16"]


def _busy() -> None:
    while True:
        pass


@pytest.mark.slow
@pytest.mark.nightly
def test_every_computation_repeats_on_its_thread_count_beside_a_load():
    """Two busy-loop processes on the machine's cores while the probe runs again: every case, dtype and
    thread count gives the bits it gave idle (nothing the trainer or the engine computes reads a clock
    or follows the load)."""
    idle = probe({})
    loops = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(2)]
    for p in loops:
        p.start()
    try:
        loaded = probe({})
    finally:
        for p in loops:
            p.kill()
            p.join()
    assert idle["digests"] == loaded["digests"]
    print(f"kernels: {idle['kind']}; bf16 units: {cpu_bf16_units()}; {len(idle['digests'])} cases x 4 thread counts")
