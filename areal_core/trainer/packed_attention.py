"""Causal attention over a packed stream of sequences, each attending only to itself.

The packed training forward keeps a micro-batch as one stream of ``T`` tokens
(``[T, heads, head_dim]``, sequences back to back). A sequence's queries may be fewer than its
keys: an answer that shares its prompt with others brings only its own queries, and attends to
the prompt's keys and values (gathered in front of its own) and causally to its own, as the last
of those positions (the causal mask aligned to the bottom right). Padding the stream to
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
each sequence goes through ``F.scaled_dot_product_attention`` with autograd. The CPU kernel
aligns its causal mask to the top left (query i sees keys 0..i), so a sequence with fewer queries
than keys passes it an explicit bottom-right mask instead.
``python -m bench dynamic_batching`` measures these against the padded view and
a block-diagonal mask; flex_attention has no CPU backward and nested tensors no causal SDPA
(torch 2.13).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _bounds(lens: Sequence[int]) -> list[tuple[int, int]]:
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


@functools.lru_cache(maxsize=8)
def _causal_mask(size: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask [size, size] (row r sees columns 0..r; read only)."""
    return torch.zeros(size, size, dtype=dtype).masked_fill_(
        torch.ones(size, size, dtype=torch.bool).triu(1), float("-inf")
    )


def _lower_right_mask(n_q: int, n_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, n_q, n_k] by which query i sees keys 0..n_k - n_q + i (read only): rows
    n_k - n_q .. n_k - 1 of a causal mask, a view of one cached per power-of-two size, so the cache
    stays a few masks of the longest sequence's size whatever lengths come."""
    return _causal_mask(1 << (n_k - 1).bit_length(), dtype)[n_k - n_q : n_k, :n_k][None, None]


def _flash_args(n_q: int, n_k: int, dtype: torch.dtype) -> dict:
    """The CPU flash kernel's causal arguments for ``n_q`` queries that are the last of ``n_k`` keys."""
    if n_q == n_k:
        return {"is_causal": True}
    return {"is_causal": False, "attn_mask": _lower_right_mask(n_q, n_k, dtype)}


class _FlashPerSequenceCPU(torch.autograd.Function):
    """Per-sequence causal flash attention on CPU; q [Tq, hq, d], k and v [Tk, hkv, d] (GQA allowed);
    ``bounds``: each sequence's (query, key) stream bounds."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale):
        q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
        outs, lses = [], []
        for (a, b), (c, e) in bounds:
            args = _flash_args(b - a, e - c, q.dtype)
            o, lse = _FLASH_CPU(q4[:, :, a:b], k4[:, :, c:e], v4[:, :, c:e], 0.0, scale=scale, **args)
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
        for ((a, b), (c, e)), o, lse in zip(ctx.bounds, outs, lses):
            args = _flash_args(b - a, e - c, q.dtype)
            gq, gk, gv = _FLASH_CPU_BACKWARD(
                g4[:, :, a:b], q4[:, :, a:b], k4[:, :, c:e], v4[:, :, c:e], o, lse, 0.0, scale=ctx.scale, **args
            )
            dq.append(gq)
            dk.append(gk)
            dv.append(gv)
        return tuple(_tokens_first(g).to(dtype) for g in (dq, dk, dv)) + (None, None)


def per_sequence_sdpa(q, k, v, lens: Sequence[int], scale: float, key_lens: Sequence[int] | None = None):
    """The same attention through ``F.scaled_dot_product_attention`` per sequence, with autograd
    (any device; on CPU about 2x the fused path's time on the tiny model)."""
    outs = []
    for (a, b), (c, e) in zip(_bounds(lens), _bounds(key_lens or lens)):
        causal = {"is_causal": True} if b - a == e - c else {"attn_mask": causal_lower_right(b - a, e - c)}
        o = F.scaled_dot_product_attention(
            _heads_first(q[a:b]), _heads_first(k[c:e]), _heads_first(v[c:e]), scale=scale, enable_gqa=True, **causal
        )
        outs.append(o)
    return _tokens_first(outs)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: Sequence[int],
    scale: float,
    key_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence of the packed stream to itself.

    ``q``: [Tq, hq, d]; ``k``, ``v``: [Tk, hkv, d] with ``hq`` a multiple of ``hkv``; ``lens``: the
    sequences' query counts in stream order, summing to Tq; ``key_lens``: their key counts, summing
    to Tk, each at least its query count, the queries being the last positions of the sequence's keys
    (None: ``lens``, every position a query). Returns [Tq, hq, d].
    """
    key_lens = lens if key_lens is None else key_lens
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"packed attention wants q [T, hq, d] and k, v [T, hkv, d]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if sum(lens) != q.shape[0] or min(lens, default=0) < 1:
        raise ValueError(f"sequence lengths {list(lens)} do not tile the packed stream of {q.shape[0]} queries")
    if len(key_lens) != len(lens) or sum(key_lens) != k.shape[0] or any(m < n for n, m in zip(lens, key_lens)):
        raise ValueError(
            f"key counts {list(key_lens)} do not tile the {k.shape[0]} keys with at least each sequence's "
            f"queries ({list(lens)})"
        )
    if q.device.type == "cpu":
        return _FlashPerSequenceCPU.apply(q, k, v, list(zip(_bounds(lens), _bounds(key_lens))), scale)
    return per_sequence_sdpa(q, k, v, lens, scale, key_lens)
