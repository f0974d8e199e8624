"""A model of SmolLM2-135M's shapes with random weights, as an HF folder, for a GPU machine its GGUF
did not reach (``python -m infra.gpu_smoke.shapes --spec DIR --out DIR``).

Its speed and the equality checks (engine vs HF, trainer vs the CPU float32 trainer, megatron) hold
for SmolLM2's shapes; what needs its knowledge does not: its answers are noise, so the RL run's
accuracy stays 0 (its ledger, staleness and weight-update checks still hold)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def build(spec: Path, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig.from_pretrained(spec)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(spec).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def unpack(spec: Path, into: Path) -> Path:
    """``spec`` itself if it is a folder; a ``.tar.xz`` of one (what pack.py writes) extracted into ``into``."""
    if spec.is_dir():
        return spec
    import tarfile

    with tarfile.open(spec) as tar:
        names = {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(into, filter="data")
    if len(names) != 1:
        raise ValueError(f"{spec} should hold one folder, holds {sorted(names)}")
    return into / names.pop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.gpu_smoke.shapes", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--spec",
        required=True,
        help="config + tokenizer: a folder or its .tar.xz (infra/gpu_wheels/smollm2-spec.tar.xz)",
    )
    ap.add_argument("--out", required=True, help="the HF folder to write")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(build(unpack(Path(args.spec), out.parent), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
