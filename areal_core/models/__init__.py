"""Policy models: the tiny Qwen2 + char tokenizer, SmolLM2-135M, HF folders."""

from areal_core.models.loading import load_base_model, load_hf_folder
from areal_core.models.smollm2 import SmolLM2Unavailable, find_smollm2_gguf, load_smollm2, smollm2_available
from areal_core.models.tiny import build_tiny, tiny_config
from areal_core.models.tokenizer import build_char_tokenizer
from areal_core.models.warmstart import cached_warm_start, default_cache_dir, load_optimizer_moments, warm_start

__all__ = [
    "SmolLM2Unavailable",
    "build_char_tokenizer",
    "build_tiny",
    "cached_warm_start",
    "default_cache_dir",
    "find_smollm2_gguf",
    "load_base_model",
    "load_hf_folder",
    "load_optimizer_moments",
    "load_smollm2",
    "smollm2_available",
    "tiny_config",
    "warm_start",
]
