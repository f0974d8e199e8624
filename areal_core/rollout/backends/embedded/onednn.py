"""bfloat16 matrix products on a CPU with their weights packed once, in oneDNN's blocked layout.

``F.linear`` in bfloat16 on a CPU calls oneDNN, which lays the weight out for its kernel on every
call; a decode step makes seven products a layer, each over a few dozen rows, so that reordering
is a large share of their time (the LM head's most of all). :func:`pack` does it once per weight
version, and the products here take the packed weight. Their epilogues also take the work that
followed them: the residual add (``h + x @ W^T``), and SiLU and the product with ``up`` of the
gated MLP, each computed in float32 and rounded to bfloat16 once.

A packed weight is an opaque oneDNN tensor (``layout=torch._mkldnn``): only these functions take it.
"""

from __future__ import annotations

import torch

_ops = torch.ops.mkldnn


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`pack` and the products below run here: bfloat16 weights on a CPU whose torch has
    oneDNN with bfloat16 support (which needs the CPU's bf16 units or AVX-512)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(_ops, "_reorder_linear_weight")
        and hasattr(_ops, "_linear_pointwise")
        and hasattr(_ops, "_is_mkldnn_bf16_supported")
        and bool(_ops._is_mkldnn_bf16_supported())
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` laid out for oneDNN's products (a copy)."""
    return _ops._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` (``w``: :func:`pack` of W)."""
    return _ops._linear_pointwise(x, w, b, "none", [], "")


def linear_silu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ W^T + b)``."""
    return _ops._linear_pointwise(x, w, b, "swish", [], "")


def linear_mul(x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ W^T + b) * other``."""
    return _ops._linear_pointwise.binary(x, other, w, b, "mul")


def linear_add(x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ W^T + b) + other``."""
    return _ops._linear_pointwise.binary(x, other, w, b, "add")
