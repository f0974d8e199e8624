"""Policy models: the tiny Qwen2 + char tokenizer, SmolLM2-135M, HF folders.

The names below are loaded on first use: importing a submodule that needs no model class (the
config, the tokenizer) does not pay for transformers' model code (seconds per process)."""

from __future__ import annotations

import importlib

_WHERE = {
    "load_base_model": "loading",
    "load_hf_folder": "loading",
    "SmolLM2Unavailable": "smollm2",
    "find_smollm2_gguf": "smollm2",
    "load_smollm2": "smollm2",
    "smollm2_available": "smollm2",
    "build_tiny": "tiny",
    "tiny_config": "tiny",
    "build_char_tokenizer": "tokenizer",
    "cached_warm_start": "warmstart",
    "default_cache_dir": "warmstart",
    "load_optimizer_moments": "warmstart",
    "warm_start": "warmstart",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
