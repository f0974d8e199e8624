from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_core.configbase import Section


class TinyArch(Section):
    """Shape of the `tiny` Qwen2-architecture model (built from scratch)."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_position_embeddings: int = Field(512, gt=0)


class WarmStart(Section):
    """Supervised warm start on the task's reference solutions before RL (0 steps: none)."""

    steps: int = Field(600, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(1e-3, gt=0)


class ModelConfig(Section):
    # `tiny`, `smollm2-135m`, or an HF model folder (local path, file:// or s3:// URL)
    name: str = "tiny"
    tiny: TinyArch = TinyArch()
    warm_start: WarmStart = WarmStart()
    dtype: Literal["float32", "bfloat16"] = "float32"
