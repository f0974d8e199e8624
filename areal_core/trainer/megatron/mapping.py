"""A Hugging Face Llama / Qwen2 / Qwen3 decoder as a megatron-core ``GPTModel``, and the weights both ways.

Layouts (per tensor-parallel rank ``r`` of ``tp``; round trips to the HF layout are checked bit-exact in tests/e2e/test_megatron.py):

- ``linear_qkv``: per KV group ``g``, ``[q heads of g; k_g; v_g]``; rank r holds groups
  ``[r * G/tp, (r+1) * G/tp)`` (megatron splits the fused output dimension evenly);
- ``linear_fc1``: ``[gate_r; up_r]`` with ``gate_r = gate.chunk(tp)[r]`` (likewise up);
- ``linear_proj`` / ``linear_fc2``: o_proj / down_proj split along the input dimension;
- embedding / output layer: split along the vocabulary, padded with zero rows to a multiple of tp
  (the padded logits are dropped before the softmax; :func:`megatron_to_hf` drops the rows);
- norms (incl. Qwen3's ``q_norm`` / ``k_norm`` -> ``q_layernorm`` / ``k_layernorm``): replicated.

HF names are those of ``model.named_parameters()``: a tied ``lm_head`` is ``model.embed_tokens`` once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Arch:
    model_type: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    max_positions: int

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp


def arch_of(hf_config, tp: int = 1) -> Arch:
    """What the mapping needs from an HF config; a clear error for anything it cannot map exactly."""
    c = hf_config
    mt = getattr(c, "model_type", "?")
    if mt not in SUPPORTED:
        raise NotImplementedError(f"the megatron trainer maps {', '.join(SUPPORTED)} decoders, not model_type {mt!r}")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{mt}: hidden_act {c.hidden_act!r} (only silu / SwiGLU is mapped)")
    if getattr(c, "use_sliding_window", False):
        raise NotImplementedError(f"{mt}: sliding-window attention is not mapped to megatron")
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"{mt}: rope_type {rope.get('rope_type')!r} (only the default RoPE is mapped)")
    if getattr(c, "mlp_bias", False):
        raise NotImplementedError(f"{mt}: mlp_bias=True is not mapped")
    if mt == "qwen2":  # Qwen2: biases on q, k, v only
        qkv_bias = True
    elif getattr(c, "attention_bias", False):  # Llama / Qwen3 put it on o_proj too: megatron has no such mix
        raise NotImplementedError(f"{mt}: attention_bias=True is not mapped")
    else:
        qkv_bias = False
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    check_tp(tp, heads, kv)
    return Arch(
        mt,
        c.num_hidden_layers,
        c.hidden_size,
        heads,
        kv,
        head_dim,
        c.intermediate_size,
        c.vocab_size,
        float(c.rms_norm_eps),
        float(rope["rope_theta"]),
        qkv_bias,
        mt == "qwen3",
        bool(getattr(c, "tie_word_embeddings", False)),
        int(c.max_position_embeddings),
    )


def check_tp(tp: int, heads: int, kv_heads: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} must divide both the number of attention heads ({heads}) "
            f"and of key/value heads ({kv_heads})"
        )


def transformer_config(arch: Arch, tp: int, cpu: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=arch.n_layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=arch.eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu,
        perform_initialization=False,
        # fused kernels are CUDA-only (and Apex / Transformer Engine are absent)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )


def build_gpt(arch: Arch, tp: int, cpu: bool = True):
    """A GPTModel with the local (no Transformer Engine) layer spec; parameters uninitialised
    (load them with :func:`hf_to_megatron`). Needs megatron's model parallelism initialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    return GPTModel(
        transformer_config(arch, tp, cpu),
        spec,
        vocab_size=arch.padded_vocab(tp),
        max_sequence_length=arch.max_positions,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tied,
        parallel_output=True,
    )  # vocab-parallel logits (gathering them is CUDA-only in megatron)


def hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Every HF parameter's name and shape, in the HF model's order."""
    a, hd = arch, arch.head_dim
    out = {"model.embed_tokens.weight": (a.vocab, a.hidden)}
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (a.heads * hd, a.hidden)
        if a.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (a.heads * hd,)
        out[p + "self_attn.k_proj.weight"] = (a.kv_heads * hd, a.hidden)
        if a.qkv_bias:
            out[p + "self_attn.k_proj.bias"] = (a.kv_heads * hd,)
        out[p + "self_attn.v_proj.weight"] = (a.kv_heads * hd, a.hidden)
        if a.qkv_bias:
            out[p + "self_attn.v_proj.bias"] = (a.kv_heads * hd,)
        out[p + "self_attn.o_proj.weight"] = (a.hidden, a.heads * hd)
        if a.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "mlp.gate_proj.weight"] = (a.ffn, a.hidden)
        out[p + "mlp.up_proj.weight"] = (a.ffn, a.hidden)
        out[p + "mlp.down_proj.weight"] = (a.hidden, a.ffn)
        out[p + "input_layernorm.weight"] = (a.hidden,)
        out[p + "post_attention_layernorm.weight"] = (a.hidden,)
    out["model.norm.weight"] = (a.hidden,)
    if not a.tied:
        out["lm_head.weight"] = (a.vocab, a.hidden)
    return out


def is_sharded(megatron_name: str) -> bool:
    """Whether tensor parallelism splits this megatron parameter (else every rank holds all of it: the
    norms). From the layout above, not megatron's ``tensor_model_parallel`` attribute, which its
    layers set only when they initialise the weights (``perform_initialization``)."""
    return not megatron_name.endswith("layernorm.weight")


def _pad_vocab(w: torch.Tensor, arch: Arch, tp: int) -> torch.Tensor:
    extra = arch.padded_vocab(tp) - arch.vocab
    return torch.cat([w, w.new_zeros(extra, *w.shape[1:])]) if extra else w


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    """[q; k; v] per KV group, over all groups (any trailing dims: weight or bias)."""
    g, hd = arch.kv_heads, arch.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def _unfuse_qkv(fused: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = arch.kv_heads, arch.head_dim
    rest = fused.shape[1:]
    q, k, v = fused.reshape(g, -1, *rest).split([arch.heads // g * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: Arch, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s shard of every megatron parameter, from full HF tensors
    (HF names as :func:`hf_shapes`; works for anything shaped like the weights, e.g. Adam moments)."""
    missing = [n for n in hf_shapes(arch) if n not in hf]
    if missing:
        raise KeyError(f"HF weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    out = {"embedding.word_embeddings.weight": _pad_vocab(hf["model.embed_tokens.weight"], arch, tp).chunk(tp)[rank]}
    for i in range(arch.n_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        at = h + "self_attn."
        qkv = _fuse_qkv(hf[at + "q_proj.weight"], hf[at + "k_proj.weight"], hf[at + "v_proj.weight"], arch)
        out[m + "self_attention.linear_qkv.weight"] = qkv.chunk(tp)[rank]
        if arch.qkv_bias:
            b = _fuse_qkv(hf[at + "q_proj.bias"], hf[at + "k_proj.bias"], hf[at + "v_proj.bias"], arch)
            out[m + "self_attention.linear_qkv.bias"] = b.chunk(tp)[rank]
        out[m + "self_attention.linear_proj.weight"] = hf[at + "o_proj.weight"].chunk(tp, dim=1)[rank]
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[at + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[at + "k_norm.weight"]
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not arch.tied:
        out["output_layer.weight"] = _pad_vocab(hf["lm_head.weight"], arch, tp).chunk(tp)[rank]
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], arch: Arch) -> dict[str, torch.Tensor]:
    """Full HF tensors from every tensor-parallel rank's shard (``shards[r]`` = rank r's), in
    :func:`hf_shapes`' order. Inverse of :func:`hf_to_megatron`, bit for bit."""

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight")[: arch.vocab]}
    for i in range(arch.n_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        at = h + "self_attn."
        q, k, v = _unfuse_qkv(cat(m + "self_attention.linear_qkv.weight"), arch)
        out[at + "q_proj.weight"] = q
        if arch.qkv_bias:
            qb, kb, vb = _unfuse_qkv(cat(m + "self_attention.linear_qkv.bias"), arch)
            out[at + "q_proj.bias"] = qb
        out[at + "k_proj.weight"] = k
        if arch.qkv_bias:
            out[at + "k_proj.bias"] = kb
        out[at + "v_proj.weight"] = v
        if arch.qkv_bias:
            out[at + "v_proj.bias"] = vb
        out[at + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", dim=1)
        if arch.qk_norm:
            out[at + "q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"]
            out[at + "k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"]
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", dim=1)
        out[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"]
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
    if not arch.tied:
        out["lm_head.weight"] = cat("output_layer.weight")[: arch.vocab]
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def load_into(model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy one rank's shard (:func:`hf_to_megatron`) into the megatron module; names and shapes must match."""
    params = dict(model.named_parameters())
    if set(params) != set(shard):
        raise KeyError(
            f"megatron parameters and shard differ: only in the model {sorted(set(params) - set(shard))[:3]}, "
            f"only in the shard {sorted(set(shard) - set(params))[:3]}"
        )
    for name, p in params.items():
        if p.shape != shard[name].shape:
            raise ValueError(f"{name}: the model has shape {tuple(p.shape)}, the shard {tuple(shard[name].shape)}")
        p.copy_(shard[name])
