"""The Llama-family decoders areal-flow runs its own forward passes over, and what those passes
share: the one check that a model is such a decoder, and the one form of its rotary embedding.

Two forwards exist because they do different jobs: the rollout engine's (``rollout/backends/embedded/kv_forward.py``:
prefill and decode over fused weight copies and a KV cache, no autograd) and the trainer's
(``trainer/packed_forward.py``: one packed stream through the model's own modules, so gradients
reach its parameters). Both accept exactly the models :func:`check_decoder` accepts and rotate
queries and keys with :func:`rope_table` and :func:`apply_rope`, so a model the trainer trains is
a model the engine serves, with the same positions.
"""

from __future__ import annotations

import torch

SUPPORTED = ("llama", "qwen2", "mistral")
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")  # tables that rescale with the sequence length


class UnsupportedModelError(ValueError):
    """The model uses an architecture or feature areal-flow's forward passes do not implement."""


def check_decoder(model: torch.nn.Module, *, training: bool = False) -> None:
    """Raise UnsupportedModelError unless ``model`` is a decoder both forwards run exactly
    (``training``: also no attention dropout, which the packed forward does not apply)."""
    cfg = model.config
    arch = getattr(cfg, "model_type", "?")
    if arch not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {arch!r} is not supported (supported decoders: {', '.join(SUPPORTED)})"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    # a Mistral's window is its config's sliding_window (its attention takes it from there); a Qwen2's
    # only where use_sliding_window says so
    windowed = getattr(cfg, "use_sliding_window", False) or (arch == "mistral" and getattr(cfg, "sliding_window", None))
    if any(t != "full_attention" for t in layer_types) or windowed:
        raise UnsupportedModelError(f"{arch}: sliding-window attention is not supported")
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if inner is None or not hasattr(inner, name):
            raise UnsupportedModelError(f"{arch}: model.model.{name} is missing; not a supported decoder layout")
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r} rescales with the sequence length; a fixed table is needed "
            f"(supported: static types such as 'default', 'linear', 'llama3', 'yarn')"
        )
    for layer in inner.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise UnsupportedModelError(f"{arch}: q/k norms are not supported")
        if getattr(attn, "sliding_window", None):
            raise UnsupportedModelError(f"{arch}: sliding-window attention is not supported")
    if training and getattr(cfg, "attention_dropout", 0.0):
        raise UnsupportedModelError(
            f"{arch}: attention dropout is not supported in training "
            f"(model.config.attention_dropout = {cfg.attention_dropout})"
        )


def rope_table(rotary: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 2, head_dim]``: the cos and the *signed* sin (first half negated) of each position,
    from the model's own rotary module, for :func:`apply_rope`."""
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=positions.device), positions[None])
    sin = sin[0].clone()
    sin[:, : sin.shape[-1] // 2].neg_()
    return torch.stack((cos[0], sin), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the last dimension, written as
    ``x * cos + roll(x, d/2) * signed_sin`` (``roll`` gives ``[x2, x1]``, the signed sin makes it
    ``[-x2, x1]``). ``inplace``: overwrite ``x`` (the engine's views into its fused projections)."""
    rolled = x.roll(x.shape[-1] // 2, -1)
    if inplace:
        return x.mul_(cos).addcmul_(rolled, signed_sin)
    return x * cos + rolled * signed_sin
