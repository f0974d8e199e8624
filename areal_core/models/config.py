from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import Field

from areal_core.configbase import Section


class TinyArch(Section):
    """Shape of the `tiny` Qwen2-architecture model (built from scratch)."""

    hidden_size: int = Field(128, gt=0)  # width of the residual stream; a multiple of num_heads
    num_layers: int = Field(2, gt=0)  # decoder layers
    num_heads: int = Field(4, gt=0)  # attention (query) heads; a multiple of num_kv_heads
    num_kv_heads: int = Field(2, gt=0)  # key/value heads, each shared by num_heads / num_kv_heads query heads
    intermediate_size: int = Field(512, gt=0)  # width of each layer's MLP
    max_position_embeddings: int = Field(512, gt=0)  # context length in tokens: caps a trajectory (prompt + answer)


class WarmStart(Section):
    """Supervised warm start on the task's reference solutions before RL (0 steps: none)."""

    steps: int = Field(600, ge=0)  # AdamW steps (the most, with stop_at_accuracy); 0: no warm start
    batch_size: int = Field(32, gt=0)  # demonstrations per step, drawn at random (seeded)
    lr: float = Field(1e-3, gt=0)  # the first step's learning rate; it decays linearly to 10% of it over `steps`
    # Chain task only: draw demonstrations with P(chain length k) proportional to
    # k**-length_alpha instead of the train split's own distribution. A value
    # above data.synthetic.alpha makes the demonstrations mostly short, so the
    # model starts strong on short chains and partial on long ones, and RL has
    # the long chains to learn from its own rewarded answers. None: as drawn.
    length_alpha: float | None = Field(None, ge=0)
    # Stop early once the model's greedy accuracy on a validation split (val_problems
    # train-share records held out of the demonstrations) reaches this, checked every
    # check_every steps; `steps` is then the most it trains (and what the lr decays over).
    # Accuracy here is exact match of the reference solution under greedy decoding, read
    # from one teacher-forced forward pass: every argmax must be the reference's next token.
    # Where a sharp jump in accuracy lands depends on the seed and the machine's
    # floating point; stopping on accuracy gives RL the same start on every one. None: no stop.
    stop_at_accuracy: float | None = Field(None, gt=0, le=1)
    check_every: int = Field(5, gt=0)  # steps between validation-accuracy checks (with stop_at_accuracy)
    # demonstrations held out as the validation split (with stop_at_accuracy; needs twice as many in all)
    val_problems: int = Field(512, gt=0)


class ModelConfig(Section):
    """The policy RL starts from (and, for `tiny`, its shape and supervised warm start)."""

    # `tiny`, `smollm2-135m`, or an HF model folder (local path, file:// or s3:// URL)
    name: str = "tiny"
    tiny: TinyArch = TinyArch()
    warm_start: WarmStart = WarmStart()
    # what the trainer and the rollout servers compute in (the trainer's master weights and optimizer
    # state stay float32): auto = bfloat16 on a GPU; on a CPU the trainer in float32 and the servers in
    # bfloat16 where the CPU has bf16 matrix units (AMX, AVX-512 BF16), else float32 (a bfloat16 trainer
    # learned less there: docs/RESULTS.md); the choice is logged at start; the tiny model always runs
    # in float32
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # where the embedded engine and the torch trainer compute: auto = CUDA when torch sees a GPU
    device: Literal["auto", "cpu", "cuda"] = "auto"


def model_context(folder: str) -> int | None:
    """The model's positions (``max_position_embeddings`` of its config.json); None if it does not say."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            n = json.load(f).get("max_position_embeddings")
    except OSError:
        return None
    return int(n) if isinstance(n, int) and n > 0 else None
