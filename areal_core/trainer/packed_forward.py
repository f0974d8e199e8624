"""Training forward pass over a packed micro-batch.

Sequences are concatenated into one stream of tokens: embeddings, projections,
MLPs and the LM head run on exactly the real tokens (no padding), and so does
attention: each sequence attends causally to itself only, one fused kernel call
per sequence on a view of the stream (``packed_attention``). Works with the
Llama-family decoders of Hugging Face transformers (Llama, Qwen2, Mistral),
reusing the model's own modules and parameters, so gradients flow into it.
"""

from __future__ import annotations

import torch

from areal_core.trainer.packed_attention import packed_causal_attention

SUPPORTED = ("llama", "qwen2", "mistral")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def check_supported(model) -> None:
    mt = getattr(model.config, "model_type", "?")
    if mt not in SUPPORTED:
        raise NotImplementedError(
            f"the packed training forward supports {', '.join(SUPPORTED)} decoders, not model_type {mt!r}"
        )
    if getattr(model.config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported by the packed forward")
    if getattr(model.config, "attention_dropout", 0.0):
        raise NotImplementedError("attention dropout is not supported by the packed forward "
                                  f"(model.config.attention_dropout = {model.config.attention_dropout})")


def response_logprobs(
    model, seqs: list[list[int]], starts: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of ``seq[start:]`` for every sequence, flattened in order.

    Token ``seq[t]`` (t >= start >= 1) is scored from the logits at position t - 1,
    as ``log_softmax(logits / temperature)``.
    """
    if not seqs:
        raise ValueError("empty micro-batch")
    inner = model.model
    dev = inner.embed_tokens.weight.device
    lens = torch.tensor([len(s) for s in seqs], device=dev)
    seq_lens = lens.tolist()
    T = sum(seq_lens)
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in seq_lens])

    h = inner.embed_tokens(ids)[None]  # [1, T, H]
    cos, sin = inner.rotary_emb(h, pos[None])
    cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, d]
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)[0]
        d = attn.head_dim
        q = attn.q_proj(x).view(T, -1, d)
        k = attn.k_proj(x).view(T, -1, d)
        v = attn.v_proj(x).view(T, -1, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = packed_causal_attention(q, k, v, seq_lens, attn.scaling).reshape(T, -1)
        h = h + attn.o_proj(o)[None]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)[0]

    # hidden states that predict the scored tokens, and those tokens
    offsets = torch.cumsum(lens, 0) - lens
    pred_idx = torch.cat([torch.arange(o + s - 1, o + l - 1, device=dev) for o, s, l in zip(offsets.tolist(), starts, lens.tolist())])
    targets = ids[pred_idx + 1]
    logits = model.lm_head(h[pred_idx]).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
