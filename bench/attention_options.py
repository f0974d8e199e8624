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


def on_whole_sequences(fn):
    """``fn`` as the trainer calls its attention, with each sequence's key count (``key_lens``; a shared
    prompt's answers bring fewer queries than keys): every sequence gets a query at each of its
    positions, zeros where the trainer has none, and only the trainer's queries' outputs are kept,
    so ``fn`` does the work it would on whole sequences (what the trainer did before it computed a
    shared prompt's attention once)."""

    def call(q, k, v, lens, scale, key_lens=None):
        if key_lens is None or list(key_lens) == list(lens):
            return fn(q, k, v, lens, scale)
        at, start = [], 0
        for n, m in zip(lens, key_lens):  # the trainer's queries are the last n of the sequence's m
            at += range(start + m - n, start + m)
            start += m
        idx = torch.tensor(at, device=q.device)
        whole = q.new_zeros(start, *q.shape[1:]).index_copy(0, idx, q)
        return fn(whole, k, v, list(key_lens), scale).index_select(0, idx)

    return call


@contextlib.contextmanager
def trainer_attention(fn):
    """Run the packed training forward with attention ``fn`` (on whole sequences: ``on_whole_sequences``)
    instead of its own (for before/after rows)."""
    saved = packed_forward.packed_causal_attention
    packed_forward.packed_causal_attention = on_whole_sequences(fn)
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
