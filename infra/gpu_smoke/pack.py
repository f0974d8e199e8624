"""Prepare, on a machine with network, what a GPU machine needs beyond a CUDA build of torch.

    .venv/bin/python -m infra.gpu_smoke.pack [--check]

Run it once; nothing here runs on the GPU machine. It writes:

* ``infra/gpu_wheels/``: the wheels of the packages the smoke run imports beyond such an environment
  (``WHEELS``, pinned to this venv's versions; Python 3.12, manylinux x86_64, no dependencies: each
  dependency it lacks is named itself), and ``smollm2-spec.tar.xz``: SmolLM2-135M's config and
  tokenizer, for a model of its shapes with random weights where its GGUF is not copied;
* ``infra/gpu_model_a/``, ``infra/gpu_model_b/``: SmolLM2-135M's GGUF file (98 MB) in two parts, each
  with the sha256 of the whole in ``manifest.json``, split so that the checkout with part a and the
  checkout with the wheels and part b are about the same size (for copying in two transfers where one
  transfer's size is limited; copy all three folders where it is not).

On the GPU machine ``infra/gpu_run.sh stage`` keeps part a in its work folder, and ``infra/gpu_run.sh``
installs the wheels and puts the GGUF together. ``--check`` only prints the sizes; with
``--max-transfer-mib N`` the command fails where a transfer would exceed N MiB. All three folders are
ignored by git.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from infra.gpu_smoke.common import REPO

# what the smoke run imports beyond the CUDA environment it was prepared for (Python 3.12 with torch,
# transformers, numpy, pandas, pyarrow, aiohttp, fsspec, pyyaml, tqdm, accelerate, safetensors,
# tokenizers, click, cloudpickle, msgpack, psutil, toolz, sortedcontainers, jinja2, packaging, h11, anyio,
# annotated-doc and sympy); versions as this venv's.
WHEELS = (
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",  # pydantic 2.14 needs a recent one; the environment's may be older
    "fastapi==0.144.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "opentelemetry-api==1.45.2",
    "dask==2026.8.0",
    "distributed==2026.8.0",
    "partd==1.4.2",
    "locket==1.0.0",
    "tblib==3.2.2",
    "zict==3.0.0",
    "tornado==6.6.1",
    "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0",
    "antlr4-python3-runtime==4.13.2",
    "gguf==0.19.0",
    "megatron-core==0.16.1",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",  # the reward cluster's TLS (Security.temporary)
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEEL_DIR, PART_A, PART_B = REPO / "infra/gpu_wheels", REPO / "infra/gpu_model_a", REPO / "infra/gpu_model_b"


def download_wheels(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
        *[a for p in PLATFORMS for a in ("--platform", p)],
        *WHEELS,
    ]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def write_spec(dest: Path) -> None:
    """``dest`` (a .tar.xz): SmolLM2-135M's config, generation config and tokenizer (no weights) from the
    packaged GGUF, compressed (3.4 MiB of JSON, mostly the tokenizer)."""
    import tarfile
    import tempfile

    from areal_core.models.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "smollm2-spec"
        model.config.save_pretrained(spec)
        model.generation_config.save_pretrained(spec)
        tokenizer.save_pretrained(spec)
        with tarfile.open(dest, "w:xz") as tar:
            tar.add(spec, arcname="smollm2-spec")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_gguf(size_a: int) -> dict:
    """Part a: the GGUF's first ``size_a`` bytes; part b: the rest; a manifest beside each."""
    from areal_core.models.smollm2 import find_smollm2_gguf

    folder, name = find_smollm2_gguf()
    src = Path(folder) / name
    data = src.read_bytes()
    manifest = {"file": name, "bytes": len(data), "sha256": _sha256(src), "split_at": size_a}
    for dest, chunk, part in ((PART_A, data[:size_a], "a"), (PART_B, data[size_a:], "b")):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        (dest / f"{name}.part-{part}").write_bytes(chunk)
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def tree_bytes() -> int:
    """Bytes of the checkout every transfer holds: tracked files and untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sum((REPO / p).stat().st_size for p in out.split("\0") if p and (REPO / p).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def report(max_mib: float | None = None) -> dict:
    tree = tree_bytes()
    sizes = {
        "tree": tree,
        "wheels_and_spec": folder_bytes(WHEEL_DIR),
        "part_a": folder_bytes(PART_A),
        "part_b": folder_bytes(PART_B),
    }
    sizes["transfer_a"] = tree + sizes["part_a"]
    sizes["transfer_b"] = tree + sizes["wheels_and_spec"] + sizes["part_b"]
    for w in sorted(WHEEL_DIR.glob("*.whl")):
        print(f"  {w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    for k, v in sizes.items():
        print(f"{k:>16}: {v / 2**20:7.2f} MiB")
    if max_mib is not None:
        sizes["fits"] = max(sizes["transfer_a"], sizes["transfer_b"]) <= max_mib * 2**20
        print(f"each transfer within {max_mib:g} MiB: {sizes['fits']}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.gpu_smoke.pack", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only print each transfer's size")
    ap.add_argument("--no-model", action="store_true", help="wheels and spec only (no GGUF parts)")
    ap.add_argument(
        "--max-transfer-mib", type=float, help="fail where a transfer (the checkout and its part) exceeds this many MiB"
    )
    args = ap.parse_args(argv)
    if not args.check:
        shutil.rmtree(WHEEL_DIR, ignore_errors=True)
        download_wheels(WHEEL_DIR)
        write_spec(WHEEL_DIR / "smollm2-spec.tar.xz")
        if not args.no_model:
            # part b goes with the wheels: split so that both transfers hold the same
            from areal_core.models.smollm2 import find_smollm2_gguf

            gguf = Path(*find_smollm2_gguf()).stat().st_size
            size_a = (gguf + folder_bytes(WHEEL_DIR)) // 2
            print(json.dumps(split_gguf(size_a)))
    return 0 if report(args.max_transfer_mib).get("fits", True) else 1


if __name__ == "__main__":
    sys.exit(main())
