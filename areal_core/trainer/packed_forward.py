"""Training forward pass over a packed micro-batch.

Sequences are concatenated into one stream of tokens: embeddings, projections,
MLPs and the LM head run on exactly the real tokens (no padding), and so does
attention: each sequence attends causally to itself only, one fused kernel call
per sequence (``packed_attention``). Works with the Llama-family decoders of
Hugging Face transformers (``models/decoder.py``), reusing the model's own
modules and parameters, so gradients flow into it.

Precision: the products (projections, attention, MLP, LM head) run in the model's dtype; the
residual stream between them, and so every norm's input, stays float32, as bfloat16 autocast over
float32 weights keeps it (and Megatron's ``fp32_residual_connection``). Rounding the stream to
bfloat16 after every layer drops the low bits of each layer's update, in the forward and in the
gradient that flows back along it; with a float32 stream a bfloat16 model's logprobs and gradients
lie closer to the exact arithmetic of its own weights (tests/unit/test_packed_forward.py).
The MLP's SiLU (forward and backward) and the RoPE table run on one thread: their kernels round the
last elements of each thread's slice otherwise than the rest, which would make the step's bits
follow the thread count (``numerics.one_thread``).

Answers to the same prompt share it: a group's prompt enters the stream once,
followed by each answer's tokens. Projections and MLPs then run on the prompt
once instead of once per answer (GRPO-style groups of 8 answers to a 30-token
prompt halve the tokens of the quickstart's batches), and so does attention: the
prompt attends to itself once, and each answer's queries attend to the prompt's
keys and values, gathered in front of its own, so every answer attends to exactly
what it would alone. Gradients that reach the shared prompt from all its answers
add up, as they would have over separate copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_core.models.decoder import apply_rope, rope_table
from areal_core.numerics import one_thread
from areal_core.trainer.packed_attention import packed_causal_attention


@dataclass
class _Layout:
    """Where every token of a micro-batch sits in the packed stream."""

    ids: list[int]  # the stream's tokens
    pos: list[int]  # their positions within their own sequence
    queries: list[int]  # attention segments' query counts, in stream order (they tile the stream)
    keys: list[int]  # their key counts: a shared prompt's answers also see the prompt
    gather: list[int] | None  # stream index of each segment key (None: the keys are the stream)
    pred: list[int]  # stream index of the hidden state that scores each response token, in input order
    targets: list[int]  # the response tokens, in input order


class _SiLUOneThread(torch.autograd.Function):
    """``F.silu`` and its gradient, each computed on one thread (``numerics.one_thread``)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with one_thread():
            return torch.nn.functional.silu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with one_thread():
            return torch.ops.aten.silu_backward(grad, x)


class _TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits.float() / temperature)`` at each row's target, and its gradient.

    The same bits as those operations under autograd, at a fraction of their memory traffic.
    Autograd would keep float32 ``[rows, vocab]`` tensors (the upcast logits, their scaled copy, the
    log-softmax and, in the backward, the scattered gradient and its scaled copy): hundreds of MB
    each for a micro-batch of a thousand tokens over a 49k vocabulary, each freshly mapped and
    faulted in. Here only the logits and their gradient exist whole, in the model's dtype; the
    float32 work runs on ``_CHUNK`` elements' worth of rows at a time, which stays in cache. Every
    float32 step is row-wise, so chunking leaves its bits unchanged (tests/unit/test_packed_forward.py).
    The LM head itself stays the model's module (its hooks and any adapter run as they would)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows in _row_chunks(logits):
            out[rows] = _log_softmax(logits[rows], temperature).gather(-1, targets[rows, None])[:, 0]
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        t = ctx.temperature
        g_logits = torch.empty_like(logits)
        for rows in _row_chunks(logits):
            ls = _log_softmax(logits[rows], t)
            g = torch.zeros_like(ls).scatter_(-1, targets[rows, None], grad[rows, None])
            g = torch._log_softmax_backward_data(g, ls, -1, torch.float32)
            g_logits[rows] = g / t if t != 1.0 else g
        return g_logits, None, None


_CHUNK = 1 << 20  # float32 elements of [rows, vocab] work at a time (4 MiB)


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    n, vocab = logits.shape
    step = max(1, _CHUNK // vocab)
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """The Llama family's gated MLP, ``down(silu(gate(x)) * up(x))``, through the model's own
    projections."""
    return mlp.down_proj(_SiLUOneThread.apply(mlp.gate_proj(x)) * mlp.up_proj(x))


def _layout(seqs: list[list[int]], starts: list[int]) -> _Layout:
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (s, st) in enumerate(zip(seqs, starts)):
        if not 1 <= st < len(s):
            raise ValueError(
                f"sequence {i}: response start {st} must lie in [1, {len(s) - 1}] (the sequence has {len(s)} tokens)"
            )
        groups.setdefault(tuple(s[:st]), []).append(i)
    targets = [t for s, st in zip(seqs, starts) for t in s[st:]]
    if len(groups) == len(seqs):  # no prompt shared: each sequence is its own segment of the stream
        ids, pos, pred, a = [], [], [], 0
        for s, st in zip(seqs, starts):
            ids += s
            pos += range(len(s))
            pred += range(a + st - 1, a + len(s) - 1)
            a += len(s)
        lens = [len(s) for s in seqs]
        return _Layout(ids, pos, lens, lens, None, pred, targets)
    ids, pos, queries, keys, gather = [], [], [], [], []
    pred_of: dict[int, list[int]] = {}
    for prompt, members in groups.items():
        n_p, p0 = len(prompt), len(ids)
        ids += prompt
        pos += range(n_p)
        queries.append(n_p)  # the prompt attends to itself, once
        keys.append(n_p)
        gather += range(p0, p0 + n_p)
        for i in members:  # each answer's queries: to the prompt, then causally to itself
            answer = seqs[i][n_p:]
            a0 = len(ids)
            ids += answer
            pos += range(n_p, n_p + len(answer))
            queries.append(len(answer))
            keys.append(n_p + len(answer))
            gather += range(p0, p0 + n_p)
            gather += range(a0, a0 + len(answer))
            pred_of[i] = [p0 + n_p - 1, *range(a0, a0 + len(answer) - 1)]
    pred = [j for i in range(len(seqs)) for j in pred_of[i]]
    return _Layout(ids, pos, queries, keys, gather, pred, targets)


def response_logprobs(model, seqs: list[list[int]], starts: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of ``seq[start:]`` for every sequence, flattened in order.

    Token ``seq[t]`` (t >= start >= 1) is scored from the logits at position t - 1,
    as ``log_softmax(logits / temperature)``. Sequences whose first ``start`` tokens
    are equal share that prompt in the stream (see the module's docstring).
    """
    if not seqs:
        raise ValueError("empty micro-batch")
    if getattr(model.config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"the packed forward computes a SiLU-gated MLP; this model's is {model.config.hidden_act!r}"
        )
    inner = model.model
    dev = inner.embed_tokens.weight.device
    lay = _layout(seqs, starts)
    T = len(lay.ids)
    ids = torch.tensor(lay.ids, device=dev)
    pos = torch.tensor(lay.pos, device=dev)
    gather = None if lay.gather is None else torch.tensor(lay.gather, device=dev)

    low = inner.embed_tokens.weight.dtype  # the products' dtype; the residual stream is float32
    h = inner.embed_tokens(ids)[None].float()  # [1, T, H]
    with one_thread():
        rope = rope_table(inner.rotary_emb, pos, low)
    cos, sin = rope[:, None, 0], rope[:, None, 1]  # [T, 1, d]; sin signed (decoder.apply_rope)
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)[0].to(low)
        d = attn.head_dim
        q = attn.q_proj(x).view(T, -1, d)
        k = attn.k_proj(x).view(T, -1, d)
        v = attn.v_proj(x).view(T, -1, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if gather is not None:  # each answer's keys and values: its prompt's, then its own
            k, v = k.index_select(0, gather), v.index_select(0, gather)
        o = packed_causal_attention(q, k, v, lay.queries, attn.scaling, lay.keys)
        h = h + attn.o_proj(o.reshape(T, -1))[None]
        h = h + _mlp(layer.mlp, layer.post_attention_layernorm(h).to(low))
    h = inner.norm(h)[0].to(low)

    pred = torch.tensor(lay.pred, device=dev)
    targets = torch.tensor(lay.targets, device=dev)
    return _TargetLogprobs.apply(model.lm_head(h.index_select(0, pred)), targets, temperature)
