"""A Llama-family decoder's parameters, without transformers' modeling code.

The rollout engine runs its own forward (``rollout/backends/embedded/kv_forward.py``): of the Hugging
Face model it reads only the config, the parameters, the norms' epsilons and the rotary table.
Building that model with transformers imports its modeling stack (torch's compiler and distributed
tensors among it) in every server process, at each start and restart. :func:`load_decoder_weights`
builds the same module tree, with Hugging Face's parameter names, shapes, dtypes and ties, from the
folder's config.json and safetensors files; :func:`~areal_core.models.decoder.check_decoder` accepts
it as it accepts the Hugging Face model, and weight updates address its parameters by the same
names. ``python -m bench server_start`` measures what a server process computes before it serves,
this way and transformers' (docs/RESULTS.md, "Starting a rollout server").

Only what a weight-for-weight copy needs is here. A config.json that states every key read
(:data:`PLAIN_KEYS`) with the default rotary table is read as it is; any other goes through
transformers' ``AutoConfig`` (a few seconds of imports, no modeling code), and the non-default
rotary tables come from transformers' own functions. A model this module does not describe
(:func:`describes`) is loaded by transformers as before.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

from areal_core.models.decoder import check_decoder
from areal_core.models.weights import apply_weights, load_model, read_weights
from areal_core.storage.localize import localize

# per model type: (q/k/v bias, output-projection bias, MLP bias, norms the engine may fuse) as the
# Hugging Face classes build them; None: read from the config's attention_bias / mlp_bias
_LAYOUT: dict[str, tuple[bool | None, bool | None, bool | None, bool]] = {
    "llama": (None, None, None, True),
    "qwen2": (True, False, False, True),
    "mistral": (False, False, False, False),
}


# config.json keys a folder's config must hold to be read without transformers (their defaults differ by
# model type and version); the others read have the defaults of every supported class
PLAIN_KEYS = (
    "model_type",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def describes(config) -> bool:
    """Whether this module builds ``config``'s model exactly (else transformers loads it)."""
    return getattr(config, "model_type", None) in _LAYOUT and getattr(config, "hidden_act", None) == "silu"


def plain_config(raw: dict) -> SimpleNamespace | None:
    """A folder's config.json read as the model's config where it says everything this module reads
    and its rotary table is the default one; None otherwise (transformers' ``AutoConfig`` reads it:
    about 3 s of imports in a server process on a 2-core AMD EPYC)."""
    if any(k not in raw for k in PLAIN_KEYS) or "rope_theta" not in {**raw, **(raw.get("rope_parameters") or {})}:
        return None
    config = SimpleNamespace(
        **{"num_key_value_heads": raw["num_attention_heads"], "attention_bias": False, "mlp_bias": False, **raw}
    )
    return config if describes(config) and rope_parameters(config)["rope_type"] == "default" else None


class _Linear(nn.Linear):
    """An ``nn.Linear`` whose parameters are allocated, not initialised: every one is read from the
    checkpoint (torch's initialisers would also import its compiler on a meta device, about 2.6 s)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """An ``nn.Embedding`` allocated, not initialised (as :class:`_Linear`)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Hugging Face's Llama/Qwen2/Mistral RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))`` in
    float32, rounded to the input's dtype before the weight. ``standard``: the engine may replace it
    by one fused call (it does so for the classes it knows, kv_forward._STANDARD_NORMS)."""

    def __init__(self, size: int, eps: float, standard: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.variance_epsilon = eps
        self.standard = standard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_parameters(config) -> dict:
    """The config's rotary parameters (``rope_type``, ``rope_theta``, scaling), whichever transformers
    wrote it: ``rope_parameters`` (5.x) or ``rope_theta`` with ``rope_scaling`` (4.x)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", None), **params}
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), "rope_theta": config.rope_theta}


class Rotary(nn.Module):
    """The rotary table of Hugging Face's Llama-family models: ``cos`` and ``sin`` of position times
    inverse frequency (float32, times the type's attention scaling), as their rotary module returns them."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        self.rope_type = params["rope_type"]
        if self.rope_type == "default":
            dims = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32)
            inv_freq, self.attention_scaling = 1.0 / (params["rope_theta"] ** (dims / head_dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config, head_dim: int, qkv_bias: bool, o_bias: bool, dtype: torch.dtype):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        self.q_proj = _Linear(hidden, heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.k_proj = _Linear(hidden, kv * head_dim, bias=qkv_bias, dtype=dtype)
        self.v_proj = _Linear(hidden, kv * head_dim, bias=qkv_bias, dtype=dtype)
        self.o_proj = _Linear(heads * head_dim, hidden, bias=o_bias, dtype=dtype)


class _MLP(nn.Module):
    def __init__(self, config, bias: bool, dtype: torch.dtype):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = _Linear(hidden, inter, bias=bias, dtype=dtype)
        self.up_proj = _Linear(hidden, inter, bias=bias, dtype=dtype)
        self.down_proj = _Linear(inter, hidden, bias=bias, dtype=dtype)
        self.act_fn = nn.SiLU()


class _Layer(nn.Module):
    def __init__(self, config, head_dim: int, layout: tuple, dtype: torch.dtype):
        super().__init__()
        qkv_bias, o_bias, mlp_bias, standard = layout
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = _Attention(
            config,
            head_dim,
            attention_bias if qkv_bias is None else qkv_bias,
            attention_bias if o_bias is None else o_bias,
            dtype,
        )
        self.mlp = _MLP(config, bool(getattr(config, "mlp_bias", False)) if mlp_bias is None else mlp_bias, dtype)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, standard, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, standard, dtype)


class _Inner(nn.Module):
    def __init__(self, config, head_dim: int, layout: tuple, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(config, head_dim, layout, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, layout[3], dtype)
        self.rotary_emb = Rotary(config, head_dim)


class DecoderWeights(nn.Module):
    """``model`` (embeddings, layers, norm, rotary table) and ``lm_head``, named as in the Hugging Face
    model; the LM head shares the embedding's weight where the config ties them. The projections' and
    the embedding's parameters are allocated in ``dtype`` and not initialised (the norms' weights are
    ones): :func:`load_decoder_weights` reads every one."""

    def __init__(self, config, generation_config=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not describes(config):
            raise ValueError(f"model_type {getattr(config, 'model_type', '?')!r}: not described here")
        self.config, self.generation_config = config, generation_config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = _Inner(config, self.head_dim, _LAYOUT[config.model_type], dtype)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


def load_decoder_weights(folder: str, dtype: torch.dtype) -> DecoderWeights | None:
    """The model in the local ``folder`` as :class:`DecoderWeights` in ``dtype``, checked as the engine
    checks a model; None where this module does not describe its type (load it with transformers)."""
    config = plain_config(_json(os.path.join(folder, "config.json")))
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        if not describes(config):
            return None
    generation = None  # (of the generation config the engine reads only the EOS ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.exists(path):
        generation = SimpleNamespace(eos_token_id=_json(path).get("eos_token_id"))
    model = DecoderWeights(config, generation, dtype)
    apply_weights(model, read_weights(model, folder))
    check_decoder(model)
    return model.eval()


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_served_model(model_path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model a rollout engine serves from a local folder or fsspec URL: :class:`DecoderWeights`
    where this module describes it, else transformers' model (:func:`~areal_core.models.weights.load_model`,
    without its progress bar)."""
    folder = localize(model_path)
    model = load_decoder_weights(folder, dtype)
    if model is None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = load_model(folder, dtype)
    return model
