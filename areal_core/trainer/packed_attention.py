"""Causal self-attention over a packed stream of sequences, each attending only to itself.

The packed training forward keeps a micro-batch as one stream of ``T`` tokens
(``[T, heads, head_dim]``, sequences back to back). Padding the stream to
``[n, L_max]`` for one batched attention call wastes work quadratic in the
length spread (a micro-batch holding one 480-token answer and sixty short ones
computes sixty 480 x 480 score blocks); a block-diagonal mask over the stream
is worse still (``T x T``). Here every sequence is its own attention call on a
strided view of the stream: no padding, no copies in, one concatenation out.

On CPU the calls go straight to PyTorch's fused flash-attention kernels
(forward and backward) inside one autograd node, which keeps the per-sequence
overhead to one kernel call each way (an autograd graph of views per sequence
costs about four times as much per sequence). A bfloat16 backward runs the
float32 kernel on its inputs cast up and casts the gradients back: PyTorch's
bfloat16 CPU backward took 3x as long as the float32 one on SmolLM2's heads
(torch 2.13, AMX Xeon), and lies further from the exact gradient. Elsewhere
each sequence goes through ``F.scaled_dot_product_attention`` with autograd.
``python -m bench dynamic_batching`` measures these against the padded view and
a block-diagonal mask; flex_attention has no CPU backward and nested tensors no causal SDPA
(torch 2.13).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _bounds(lens: list[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in lens:
        out.append((a, a + n))
        a += n
    return out


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[T, h, d] -> a [1, h, T, d] view (no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def _tokens_first(parts: list[torch.Tensor]) -> torch.Tensor:
    """[1, h, l_i, d] pieces -> one [sum l_i, h, d] stream."""
    return torch.cat([p.transpose(1, 2) for p in parts], 1)[0]


class _FlashPerSequenceCPU(torch.autograd.Function):
    """Per-sequence causal flash attention on CPU; q [T, hq, d], k and v [T, hkv, d] (GQA allowed)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale):
        q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
        outs, lses = [], []
        for a, b in bounds:
            o, lse = _FLASH_CPU(q4[:, :, a:b], k4[:, :, a:b], v4[:, :, a:b], 0.0, True, scale=scale)
            outs.append(o)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, *outs, *lses)
        ctx.bounds, ctx.scale = bounds, scale
        return _tokens_first(outs)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *rest = ctx.saved_tensors
        n = len(ctx.bounds)
        outs, lses = rest[:n], rest[n:]
        dtype = q.dtype
        if dtype == torch.bfloat16:  # its backward kernel takes 3x the float32 one's time (and is less exact)
            q, k, v, grad_out = q.float(), k.float(), v.float(), grad_out.float()
            outs = [o.float() for o in outs]
        q4, k4, v4, g4 = _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(grad_out)
        dq, dk, dv = [], [], []
        for (a, b), o, lse in zip(ctx.bounds, outs, lses):
            gq, gk, gv = _FLASH_CPU_BACKWARD(
                g4[:, :, a:b], q4[:, :, a:b], k4[:, :, a:b], v4[:, :, a:b], o, lse, 0.0, True, scale=ctx.scale
            )
            dq.append(gq)
            dk.append(gk)
            dv.append(gv)
        return tuple(_tokens_first(g).to(dtype) for g in (dq, dk, dv)) + (None, None)


def per_sequence_sdpa(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """The same attention through ``F.scaled_dot_product_attention`` per sequence, with autograd
    (any device; on CPU about 2x the fused path's time on the tiny model)."""
    outs = []
    for a, b in _bounds(lens):
        o = F.scaled_dot_product_attention(
            _heads_first(q[a:b]),
            _heads_first(k[a:b]),
            _heads_first(v[a:b]),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(o)
    return _tokens_first(outs)


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention of each sequence of the packed stream to itself.

    ``q``: [T, hq, d]; ``k``, ``v``: [T, hkv, d] with ``hq`` a multiple of ``hkv``;
    ``lens``: the sequences' lengths in stream order, summing to T. Returns [T, hq, d].
    """
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"packed attention wants q [T, hq, d] and k, v [T, hkv, d]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if sum(lens) != q.shape[0] or k.shape[0] != q.shape[0] or min(lens, default=0) < 1:
        raise ValueError(f"sequence lengths {lens} do not tile the packed stream of {q.shape[0]} tokens")
    if q.device.type == "cpu":
        return _FlashPerSequenceCPU.apply(q, k, v, _bounds(lens), scale)
    return per_sequence_sdpa(q, k, v, lens, scale)
