"""The `tiny` model: a small Qwen2-architecture causal LM built from a config."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_core.models.config import TinyArch


def tiny_config(arch: TinyArch, tokenizer) -> Qwen2Config:
    if arch.hidden_size % arch.num_heads:
        raise ValueError(f"hidden_size {arch.hidden_size} is not a multiple of num_heads {arch.num_heads}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"num_heads {arch.num_heads} is not a multiple of num_kv_heads {arch.num_kv_heads}")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        use_sliding_window=False,
        dtype="float32",
    )


def build_tiny(arch: TinyArch, tokenizer, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2 model (float32); same seed, same weights."""
    config = tiny_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):  # seeded init, caller's RNG untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model
