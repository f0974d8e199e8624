"""The two benchmark models as Hugging Face folders: `tiny` (quickstart shape) and SmolLM2-135M."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

QUICKSTART_TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
CACHE = Path(os.environ.get("AREAL_BENCH_CACHE", Path.home() / ".cache" / "areal-flow" / "bench"))


def build_tiny_model(seed: int = 0):
    """(model, tokenizer): the quickstart's tiny Qwen2 (0.5M parameters), random weights."""
    from areal_core.models import build_char_tokenizer, build_tiny
    from areal_core.models.config import TinyArch

    tok = build_char_tokenizer()
    return build_tiny(TinyArch(**QUICKSTART_TINY), tok, seed), tok


def _save(model, tok, folder: Path) -> str:
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(folder)


def tiny_folder(seed: int = 0) -> str:
    folder = CACHE / f"tiny-seed{seed}"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        model, tok = build_tiny_model(seed)
        _save(model, tok, folder)
    return str(folder)


def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a float32 safetensors folder (made once from the packaged GGUF)."""
    folder = CACHE / "smollm2-135m"
    if not (folder / "config.json").exists():
        from areal_core.models import load_smollm2

        folder.parent.mkdir(parents=True, exist_ok=True)
        from transformers import AutoModelForCausalLM

        gguf_model, tok = load_smollm2(torch.float32)
        # a model loaded from GGUF refuses save_pretrained: copy its dequantised weights into a plain one
        plain = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.config.quantization_config = None
        _save(plain, tok, folder)
    return str(folder)


def model_folder(name: str) -> str:
    if name == "tiny":
        return tiny_folder()
    if name == "smollm2-135m":
        return smollm2_folder()
    raise ValueError(f"unknown benchmark model {name!r}")


def load(name: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_folder(name), dtype=dtype).eval()


def n_params(model, include_embedding: bool = False) -> int:
    """Parameters that take part in a matmul per token: everything but the embedding lookup
    (a tied LM head is counted once, as the LM head)."""
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    total = sum(p.numel() for p in model.parameters())  # tied weights appear once
    if include_embedding or tied:
        return total
    return total - emb.numel()
