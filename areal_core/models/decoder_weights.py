"""A Llama-family decoder's parameters, without transformers' modeling code.

The rollout engine runs its own forward (``rollout/backends/embedded/kv_forward.py``): of the Hugging
Face model it reads only the config, the parameters, the norms' epsilons and the rotary table. Building
that model with transformers imports its modeling stack (torch's compiler and distributed tensors
among it), which cost a server process about 5 s of CPU before it loaded a weight (a 2-core AMD EPYC,
a tiny model: 10.4 s to import and load against 5 s here). :func:`load_decoder_weights` builds the
same module tree, with Hugging Face's parameter names, shapes and dtypes, from the folder's config and
safetensors files; :func:`~areal_core.models.decoder.check_decoder` accepts it as it accepts the
Hugging Face model, and weight updates address its parameters by the same names.

Only what a weight-for-weight copy needs is here: the config is transformers' own (``AutoConfig``, a
light import), non-default rotary tables come from transformers' own functions, and a model this
module does not describe exactly (:func:`describes`) is loaded by transformers as before.
"""

from __future__ import annotations

import os

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


def describes(config) -> bool:
    """Whether this module builds ``config``'s model exactly (else transformers loads it)."""
    return getattr(config, "model_type", None) in _LAYOUT and getattr(config, "hidden_act", None) == "silu"


class RMSNorm(nn.Module):
    """Hugging Face's Llama/Qwen2/Mistral RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))`` in
    float32, rounded to the input's dtype before the weight. ``standard``: the engine may replace it
    by one fused call (it does so for the classes it knows, kv_forward._STANDARD_NORMS)."""

    def __init__(self, size: int, eps: float, standard: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
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
        return {"rope_type": "default", **params}
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
    def __init__(self, config, head_dim: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)


class _MLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = nn.SiLU()


class _Layer(nn.Module):
    def __init__(self, config, head_dim: int, layout: tuple):
        super().__init__()
        qkv_bias, o_bias, mlp_bias, standard = layout
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = _Attention(
            config,
            head_dim,
            attention_bias if qkv_bias is None else qkv_bias,
            attention_bias if o_bias is None else o_bias,
        )
        self.mlp = _MLP(config, bool(getattr(config, "mlp_bias", False)) if mlp_bias is None else mlp_bias)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, standard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, standard)


class _Inner(nn.Module):
    def __init__(self, config, head_dim: int, layout: tuple):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config, head_dim, layout) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, layout[3])
        self.rotary_emb = Rotary(config, head_dim)


class DecoderWeights(nn.Module):
    """``model`` (embeddings, layers, norm, rotary table) and ``lm_head``, named as in the Hugging Face
    model; the LM head shares the embedding's weight where the config ties them."""

    def __init__(self, config, generation_config=None):
        super().__init__()
        if not describes(config):
            raise ValueError(f"model_type {getattr(config, 'model_type', '?')!r}: not described here")
        self.config, self.generation_config = config, generation_config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = _Inner(config, self.head_dim, _LAYOUT[config.model_type])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie()

    def tie(self) -> None:
        """The LM head takes the embedding's weight where the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


def load_decoder_weights(folder: str, dtype: torch.dtype) -> DecoderWeights | None:
    """The model in the local ``folder`` as :class:`DecoderWeights` in ``dtype``, checked as the engine
    checks a model; None where this module does not describe its type (load it with transformers)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    if not describes(config):
        return None
    generation = None
    if os.path.exists(os.path.join(folder, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(folder)
    with torch.device("meta"):  # no memory and no random init: every parameter is read below
        model = DecoderWeights(config, generation).to(dtype)
    model.to_empty(device="cpu")
    model.tie()
    # the rotary table is computed, not read: on the CPU, in float32 as transformers keeps it
    model.model.rotary_emb = Rotary(config, model.head_dim)
    apply_weights(model, read_weights(model, folder))
    check_decoder(model)
    return model.eval()


def load_served_model(model_path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model a rollout engine serves from a local folder or fsspec URL: :class:`DecoderWeights`
    where this module describes it, else transformers' model (:func:`~areal_core.models.weights.load_model`)."""
    folder = localize(model_path)
    return load_decoder_weights(folder, dtype) or load_model(folder, dtype)
