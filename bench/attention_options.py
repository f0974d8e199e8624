"""Attention over a packed micro-batch, the options side by side (used by bench/dynamic_batching.py).

Each option maps a packed stream (q [T, hq, d], k and v [T, hkv, d], sequence lengths)
to the causal attention of every sequence to itself. The trainer uses
``packed_causal_attention``; the others are the measured alternatives:

* ``padded``: right-pad to [n, L_max] and one batched SDPA call (the trainer's earlier code);
* ``per_sequence_sdpa``: one autograd SDPA call per sequence on views of the stream;
* ``block_diagonal_mask``: one SDPA call over the whole stream with a [T, T] mask.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from areal_core.trainer import packed_forward
from areal_core.trainer.packed_attention import packed_causal_attention, per_sequence_sdpa


def padded(q, k, v, lens, scale):
    n, L, T = len(lens), max(lens), q.shape[0]
    row = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
    flat = row * L + torch.cat([torch.arange(x) for x in lens])  # packed token -> slot in [n, L]

    def pad(t):
        return t.new_zeros(n * L, t.shape[1], t.shape[2]).index_copy(0, flat, t).view(n, L, -1, t.shape[2])

    o = F.scaled_dot_product_attention(
        pad(q).transpose(1, 2),
        pad(k).transpose(1, 2),
        pad(v).transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(1, 2).reshape(n * L, q.shape[1], -1)[flat].view(T, q.shape[1], -1)


def block_diagonal_mask(q, k, v, lens, scale):
    T = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    idx = torch.arange(T)
    mask = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


OPTIONS = {
    "per-sequence fused (trainer)": packed_causal_attention,
    "per-sequence autograd SDPA": per_sequence_sdpa,
    "padded [n, L_max]": padded,
    "block-diagonal mask [T, T]": block_diagonal_mask,
}


@contextlib.contextmanager
def trainer_attention(fn):
    """Run the packed training forward with attention ``fn`` instead of its own (for before/after rows)."""
    saved = packed_forward.packed_causal_attention
    packed_forward.packed_causal_attention = fn
    try:
        yield
    finally:
        packed_forward.packed_causal_attention = saved


def time_forward_backward(fn, microbatches: list[list[int]], heads: int, kv_heads: int, head_dim: int) -> float:
    """CPU seconds of this thread (1 torch thread) for forward + backward of ``fn`` over
    micro-batches of the given sequence lengths."""
    g = torch.Generator().manual_seed(0)
    data = []
    for lens in microbatches:
        T = sum(lens)
        q, k, v = (torch.randn(T, h, head_dim, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads))
        data.append((lens, q, k, v, torch.randn(T, heads, head_dim, generator=g)))
    t0 = time.thread_time()
    for lens, q, k, v, grad in data:
        fn(q, k, v, lens, head_dim**-0.5).backward(grad)
    return time.thread_time() - t0
