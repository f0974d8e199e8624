"""Part (a): the environment: GPU, driver, torch, CUDA, NCCL, bf16 support, the packages the other
parts import, and one bf16 matrix product's rate (a ceiling to read the other figures against)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import shutil
import subprocess
import sys

import torch

from infra.gpu_smoke.common import Clock

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "numpy",
    "pandas",
    "pyarrow",
    "pydantic",
    "pydantic-core",
    "fastapi",
    "starlette",
    "uvicorn",
    "aiohttp",
    "dask",
    "distributed",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "gguf",
    "megatron-core",
    "fsspec",
    "pyyaml",
    "typing-extensions",
    "prefect",
)


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": "not found"}
    q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    r = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return {"nvidia_smi": r.stdout.strip() or r.stderr.strip()[:500]}


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Mean rate of ``reps`` n x n x n products on random data after two warm-ups."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        a @ b
    with Clock(device) as c:
        for _ in range(reps):
            a @ b
    return 2 * n**3 * reps / c.s / 1e12


def env_part(args) -> dict:
    from areal_core.models.smollm2 import SmolLM2Unavailable, find_smollm2_gguf

    out: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {p: _version(p) for p in PACKAGES},
    }
    try:
        out["smollm2_gguf"] = "/".join(find_smollm2_gguf())
    except SmolLM2Unavailable as e:
        out["smollm2_gguf"] = f"missing: {e}"
    out["megatron_core_importable"] = importlib.util.find_spec("megatron") is not None
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        p = torch.cuda.get_device_properties(dev)
        out.update(
            {
                "gpu": p.name,
                "capability": f"{p.major}.{p.minor}",
                "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
                "bf16_supported": torch.cuda.is_bf16_supported(),
                "cudnn": torch.backends.cudnn.version(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "tf32_matmul_allowed": torch.backends.cuda.matmul.allow_tf32,
                **_nvidia_smi(),
                "matmul_bf16_tflops": round(matmul_tflops(dev, torch.bfloat16, 8192, 10), 1),
            }
        )
    else:
        out["matmul_bf16_gflops_cpu"] = round(1000 * matmul_tflops(torch.device("cpu"), torch.bfloat16, 512, 3), 1)
    return out
