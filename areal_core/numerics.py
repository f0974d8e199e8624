"""Arithmetic that repeats: the same bits on 1 or many threads, idle or loaded, on one CPU kind.

A run's results must not follow how many threads computed them: the trainer's thread count
changes between layers while it borrows idle rollout cores (``trainer/core_lending.py``), and a
replay runs on whatever cores it has. Two things in torch's CPU arithmetic follow the thread split:

* **MKL's matrix products.** On Intel CPUs MKL may split the sum over the shared dimension of a
  product between threads (e.g. a weight gradient summed over thousands of tokens), so the bits
  follow the thread count. Its *conditional numerical reproducibility* mode ``STRICT`` makes the
  products' results independent of the thread count; ``AUTO`` keeps the fastest code path for the
  CPU it runs on (so results still differ between CPU kinds). MKL reads the mode once, at its first
  call, from ``MKL_CBWR``: importing ``areal_core`` sets it (unless the user set it), and every
  process a run starts inherits it. :func:`mkl_mode` says what MKL actually runs with;
  :func:`require_repeatable` refuses a process where MKL was used before the mode could be set.
  MKL's strict mode covers Intel CPUs' AVX2 and AVX-512 paths only: on AMD CPUs its float32
  products can still follow the thread count (a weight gradient summed over a long micro-batch,
  flash attention's query gradient). :func:`thread_invariant` says where the guarantee holds; where
  it does not, the trainer keeps one thread count (no core lending) and a replay uses the original's.
* **oneDNN's AVX-512 bfloat16 products** split a long product's sum between threads too, with the
  CPU's bf16 units (AVX-512 BF16, AMX) or without them: a weight gradient summed over thousands of
  tokens differs in a few elements between 1 and 2-4 threads, at SmolLM2's widths too. oneDNN's
  AVX2 kernels (a CPU without AVX-512, or ``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE``) do not.
* **Full reductions.** ``tensor.sum()`` over more than 32,768 elements adds one partial sum per
  thread. :func:`fixed_sum` adds in an order fixed by the tensor's size alone.
* **Elementwise kernels whose vector body and scalar tail round differently.** An elementwise op
  over more than 32,768 elements gives each thread a slice; the few elements after a slice's last
  full vector go through the op's scalar code, which for SiLU and the sigmoid in float32 (rsqrt in
  bfloat16) rounds otherwise than the vector code. Where the slices end follows the thread count,
  so the bits at their ends do too. :func:`one_thread` runs such an op where no slice ends.

What differs between CPU kinds (AVX2, AVX-512, AMX; another torch build) is the kernels
themselves: the same inputs can round differently in the last bits there. docs/OPERATIONS.md says
which guarantee holds where; :func:`cpu_kind` names the kind a run or a replay ran on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform

# MKL's mode for every process of a run: the CPU's own fastest path, results independent of threads
MKL_MODE = "AUTO,STRICT"

# mkl_cbwr_get's codes (MKL's mkl_cbwr.h); STRICT is a flag added to the branch
_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX"}
_BRANCHES.update({10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"})
_STRICT = 0x10000
_ALL = -1

# torch reduces a tensor of at least this many elements with one partial sum per thread (ATen's GRAIN_SIZE)
_GRAIN = 32768


def pin_mkl_mode() -> None:
    """Set ``MKL_CBWR`` for this process and its children, unless the user chose a mode, and keep MKL
    from choosing its own thread count (``MKL_DYNAMIC``). Effective only before MKL's first call
    (``areal_core`` does this on import)."""
    os.environ.setdefault("MKL_CBWR", MKL_MODE)
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")


@functools.cache
def _mkl_get():
    """MKL's ``cbwr_get`` inside torch's library, or None (a torch build without MKL)."""
    import torch

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            try:
                fn = ctypes.CDLL(path).mkl_serv_cbwr_get
            except (OSError, AttributeError):
                return None
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def mkl_mode() -> str | None:
    """The reproducibility mode MKL runs with in this process ("AUTO,STRICT", "OFF", ...), or None
    where torch has no MKL. (Asking makes MKL read ``MKL_CBWR`` if it had not yet.)"""
    get = _mkl_get()
    if get is None:
        return None
    code = get(_ALL)
    branch = _BRANCHES.get(code & ~_STRICT, f"branch {code & ~_STRICT}")
    return branch + (",STRICT" if code & _STRICT else "")


class NotRepeatable(RuntimeError):
    """MKL in this process runs without a thread-independent mode."""


def require_repeatable() -> str | None:
    """MKL's mode, checked to give results that do not follow the thread count: raises
    :class:`NotRepeatable` with what to do where it does not (MKL was used before ``areal_core``
    was imported, or ``MKL_CBWR`` was set without STRICT)."""
    mode = mkl_mode()
    if mode is None or mode.endswith(",STRICT"):
        return mode
    raise NotRepeatable(
        f"MKL runs in reproducibility mode {mode!r} (MKL_CBWR={os.environ.get('MKL_CBWR')!r}): its matrix "
        "products may then differ in the last bits with the thread count, so runs and replays would not "
        f"repeat. Set MKL_CBWR={MKL_MODE} (or another mode with ,STRICT) before the process starts, or "
        "import areal_core before anything calls torch's matrix products"
    )


def thread_invariant(dtype) -> tuple[bool, str]:
    """Whether torch's CPU arithmetic in ``dtype`` (a trainer's forward and backward) gives the same
    bits on any thread count in this process, and why. bfloat16 products run in oneDNN, whose AVX-512
    kernels split long sums between threads (:func:`onednn_avx512_bf16`); float32 products run in
    MKL, which promises that only in its strict mode, and that mode covers Intel CPUs' AVX2 and
    AVX-512 paths alone: on other CPUs (AMD) MKL may split a long product's sum between its threads.
    The trainer runs its elementwise ops that round by thread (SiLU) on one thread
    (:func:`one_thread`). ``tests/numerics_probe.py`` checks the claim on every kernel family a
    machine offers."""
    import torch

    if dtype == torch.bfloat16:
        if onednn_avx512_bf16():
            return False, ("bfloat16 products run in oneDNN's AVX-512 kernels, whose long sums follow the thread count")
        return True, "bfloat16 products run in oneDNN's AVX2 kernels, whose results do not follow the thread count"
    mode = mkl_mode()
    if mode is None:
        return False, f"this torch has no MKL; its {dtype} products may split their sums between threads"
    if not mode.endswith(",STRICT"):
        return False, f"MKL runs in mode {mode}, not a strict one"
    if cpu_vendor() != "GenuineIntel":
        return False, (
            f"MKL's strict mode covers Intel CPUs only; on this {cpu_vendor() or 'unknown'} CPU its "
            f"{str(dtype).removeprefix('torch.')} products may split their sums between threads"
        )
    return True, "MKL's strict mode on an Intel CPU: its products do not follow the thread count"


# oneDNN's instruction-set levels (ONEDNN_MAX_CPU_ISA), lowest first; the AVX-512 ones from AVX512_CORE
_ONEDNN_LEVELS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
)


def onednn_avx512_bf16(flags: set[str] | None = None, cap: str | None = None) -> bool:
    """Whether oneDNN computes bfloat16 products with its AVX-512 kernels (a CPU with AVX-512, with or
    without bf16 units, unless ``ONEDNN_MAX_CPU_ISA`` caps it below ``AVX512_CORE``): those kernels
    split a long product's sum between threads, so its bits follow the thread count
    (``tests/e2e/test_numerics_kernels.py`` found so with AMX, with AVX-512 BF16 alone and without
    either). oneDNN's AVX2 kernels do not."""
    flags = set(_cpu_flags()) if flags is None else flags
    return "avx512f" in flags and _onednn_level(cap) >= _ONEDNN_LEVELS.index("AVX512_CORE")


def onednn_bf16_units(flags: set[str] | None = None, cap: str | None = None) -> list[str]:
    """The CPU's bfloat16 matrix units that oneDNN may use here, as /proc/cpuinfo names them
    (``amx_bf16``, ``avx512_bf16``): those the CPU has, less those ``ONEDNN_MAX_CPU_ISA`` caps away
    (so the emulation of an AVX2-only CPU has none, as that CPU has none)."""
    flags = set(_cpu_flags()) if flags is None else flags
    level = _onednn_level(cap)
    needs = {"amx_bf16": "AVX10_1_512_AMX", "avx512_bf16": "AVX512_CORE_BF16"}
    return [u for u, isa in needs.items() if u in flags and level >= _ONEDNN_LEVELS.index(isa)]


def _onednn_level(cap: str | None) -> int:
    """The index in ``_ONEDNN_LEVELS`` of oneDNN's cap (None: the environment's; no cap: above them all)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL") if cap is None else cap
    return _ONEDNN_LEVELS.index(cap.upper()) if cap.upper() in _ONEDNN_LEVELS else len(_ONEDNN_LEVELS)


@contextlib.contextmanager
def one_thread():
    """Run the enclosed torch CPU ops on one thread, then go back to the thread count before: an
    elementwise op whose vector and scalar code round differently then gives bits fixed by its
    tensor's size alone (the module docstring). For ops that are a small share of a step."""
    import torch

    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def fixed_sum(x):
    """``x.sum()`` (all elements) in an order fixed by ``x``'s size alone, whatever the thread count:
    rows of at most 32,767 elements are each summed by one thread, then their sums likewise."""
    import torch

    x = x.reshape(-1)
    while x.numel() >= _GRAIN:
        pad = (-x.numel()) % (_GRAIN - 1)
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        x = x.view(-1, _GRAIN - 1).sum(1)  # a dimension reduction: each row on one thread, in order
    return x.sum()


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``), or ""."""
    return _cpuinfo("vendor_id")


# the instruction sets that pick different kernels (torch's vector width, bf16 and AMX units)
KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

# The environment that makes this machine compute with another CPU kind's kernels, each read once by
# a process at its start: torch's vector kernels, oneDNN's (bf16 products) and MKL's (float32
# products). Only kinds below this CPU can be emulated, and only their kernels: the cores, caches
# and clocks stay this machine's, so timings under an emulation estimate that kind, not measure it.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# each kind: the CPU flag it needs here, and its kernel variables
EMULATIONS = {
    # a CPU with AVX2 only (the AMD EPYC without AVX-512): no bf16 arithmetic worth using
    "avx2": ("avx2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    # AVX-512 with bf16 dot products but no AMX tiles (the AMD EPYC with AVX-512 BF16)
    "avx512-bf16": ("avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
}


def emulation_env(kind: str | None, environ: dict) -> dict:
    """``environ`` with the kernel variables of the emulated ``kind`` in place of its own (None: with
    none, this CPU's own kernels); raises where there is no such kind or this CPU lacks the
    instructions its kernels need."""
    if kind is None:
        return {k: v for k, v in environ.items() if k not in KERNEL_ENV}
    if kind not in EMULATIONS:
        raise ValueError(f"no emulation named {kind!r}; known: {', '.join(EMULATIONS)}")
    needs, kernels = EMULATIONS[kind]
    if needs not in _cpu_flags():
        raise ValueError(f"cannot emulate {kind!r} here: this CPU has no {needs} (emulation only lowers kernels)")
    return {**emulation_env(None, environ), **kernels}


def cpu_kind() -> dict:
    """The CPU kind and the kernels this process computes with: the CPU's model name and the
    instruction sets that choose kernels, torch's vector kernels in use (``ATEN_CPU_CAPABILITY``
    may lower them), oneDNN's and MKL's caps (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``),
    MKL's mode and torch's version."""
    import torch

    flags = set(_cpu_flags())
    return {
        "cpu": _cpuinfo("model name") or platform.processor(),
        "vendor": cpu_vendor(),
        # family and model tell apart CPUs that share a name (a hypervisor may show "AMD EPYC" alone)
        "family_model": f"{_cpuinfo('cpu family')}/{_cpuinfo('model')}",
        "machine": platform.machine(),
        "isa": [f for f in KIND_FLAGS if f in flags],
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
        "mkl_max_isa": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
        "mkl_mode": mkl_mode(),
        "torch": torch.__version__,
    }


def kind_label(kind: dict) -> str:
    """One line naming a :func:`cpu_kind`: ``AMD EPYC (avx2 avx512f avx512_bf16; kernels AVX512)``."""
    isa = " ".join(kind.get("isa", [])) or "no AVX2"
    cap = kind.get("aten_capability", "?")
    caps = (("oneDNN", "onednn_max_isa"), ("MKL", "mkl_max_isa"))
    extra = "".join(f", {lib} <= {kind[k]}" for lib, k in caps if kind.get(k, "default") != "default")
    name = kind.get("cpu") or kind.get("machine", "?")
    if kind.get("family_model", "/") != "/":
        name += f" family/model {kind['family_model']}"
    return f"{name} ({isa}; kernels {cap}{extra}; torch {kind.get('torch', '?')})"


def same_kernels(a: dict, b: dict) -> bool:
    """Whether two :func:`cpu_kind` records compute with the same kernels (so results repeat bit for
    bit between them): the same instruction sets, kernel choices and torch build."""
    keys = ("vendor", "machine", "isa", "aten_capability", "torch")
    caps = ("onednn_max_isa", "mkl_max_isa")  # "default" where a record predates the field
    return all(a.get(k) == b.get(k) for k in keys) and all(a.get(k, "default") == b.get(k, "default") for k in caps)
