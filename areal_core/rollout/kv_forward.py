"""Batched forward passes with a KV cache over a Hugging Face causal LM.

The model's own submodules do the work (embeddings, norms, q/k/v/o projections,
MLPs, rotary embedding, LM head); only the attention and the cache are ours.

Cache layout: per layer, K and V shaped ``[slots, kv_heads, capacity, head_dim]``.
Row ``i`` of the cache belongs to the ``i``-th running sequence; the caller keeps
running sequences compacted in rows ``0..n-1`` (see :meth:`KVForward.move_rows`).
Grouped-query attention reshapes the queries to ``[n, kv_heads, groups, ...]`` so
the K/V heads are never repeated in memory.
"""

from __future__ import annotations

import glob
import json
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open

from areal_core.storage.localize import localize

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_NEG_INF = float("-inf")


class UnsupportedModelError(ValueError):
    """The model uses an architecture or feature the engine does not implement."""


def check_supported(model: torch.nn.Module) -> None:
    cfg = model.config
    arch = getattr(cfg, "model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported by the rollout engine (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError(f"{arch}: sliding-window attention is not supported by the rollout engine")
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if inner is None or not hasattr(inner, name):
            raise UnsupportedModelError(f"{arch}: model.model.{name} is missing; not a supported decoder layout")
    for layer in inner.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise UnsupportedModelError(f"{arch}: q/k norms are not supported by the rollout engine")
        if getattr(attn, "sliding_window", None):
            raise UnsupportedModelError(f"{arch}: sliding-window attention is not supported by the rollout engine")


def eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The model's EOS ids, from its config and generation config."""
    ids: list[int] = []
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if e not in ids:
                ids.append(int(e))
    return ids


def load_model(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face causal LM from a local folder or fsspec URL, checked for support."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(localize(model_path), dtype=dtype).eval()
    check_supported(model)
    return model


# -- weights --------------------------------------------------------------------

def _ignored_key(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def read_weights(model: torch.nn.Module, folder: str) -> dict[str, torch.Tensor]:
    """Read and check the safetensors weights in ``folder`` against ``model``.

    Returns tensors keyed by the model's parameter names, converted to the
    model's dtypes, ready for :func:`apply_weights`. Nothing in the model is
    touched, so a bad folder leaves the running weights intact. A tied LM head
    takes the embedding's weights (its own tensor in the file, if any, is skipped).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder!r} does not exist")
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder!r}")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wanted = set(json.load(f)["weight_map"].values())
        files = [p for p in files if os.path.basename(p) in wanted]
    params = dict(model.named_parameters())  # tied parameters appear once
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in params]
    staged: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in tied or _ignored_key(name):
                    continue
                if name not in params:
                    raise ValueError(f"{os.path.basename(path)}: tensor {name!r} does not belong to the model")
                t = f.get_tensor(name)
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} in the checkpoint, {tuple(p.shape)} in the model")
                staged[name] = t.to(p.dtype)
    missing = sorted(set(params) - set(staged))
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return staged


@torch.no_grad()
def apply_weights(model: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, t in staged.items():
        params[name].copy_(t)


# -- forward passes -------------------------------------------------------------

def _fast_norm(module: torch.nn.Module):
    """The fused ``rms_norm`` kernel for a standard float32 Llama/Qwen2 RMSNorm, else the module.

    Same formula as the module (``weight * x * rsqrt(mean(x^2) + eps)``), fewer kernel launches.
    """
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm") and w is not None and eps is not None \
            and w.dtype == torch.float32:
        shape = tuple(w.shape)
        return lambda x: F.rms_norm(x, shape, w, eps)
    return module


class KVForward:
    """Prefill and decode over a model with a compacted, growable KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_slots: int,
        init_slots: int = 8,
        init_capacity: int = 256,
        attn_chunk_bytes: int = 64 << 20,
    ):
        check_supported(model)
        cfg = model.config
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        if self.n_heads % self.n_kv:
            raise UnsupportedModelError(f"{cfg.model_type}: {self.n_heads} heads do not group over {self.n_kv} kv heads")
        self.groups = self.n_heads // self.n_kv
        self.scale = self.head_dim ** -0.5
        self.max_positions = int(cfg.max_position_embeddings)
        self.vocab_size = self.embed.num_embeddings
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.max_slots = max_slots
        self.init_slots = max(1, min(init_slots, max_slots))
        self.init_capacity = max(1, min(init_capacity, self.max_positions))
        self.attn_chunk_bytes = attn_chunk_bytes
        half = self.head_dim // 2
        self._rope_sign = torch.cat((-torch.ones(half), torch.ones(self.head_dim - half))).to(self.device, self.dtype)
        self._positions = torch.arange(self.max_positions, device=self.device)
        self._norms = [(_fast_norm(l.input_layernorm), _fast_norm(l.post_attention_layernorm)) for l in self.layers]
        self._final_norm = _fast_norm(self.norm)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    # cache management ------------------------------------------------------
    def release(self) -> None:
        self.k, self.v = [], []
        self.slots = self.capacity = 0

    def ensure(self, slots: int, length: int) -> None:
        """Make room for ``slots`` rows of ``length`` positions, keeping the contents."""
        if slots <= self.slots and length <= self.capacity:
            return
        if slots > self.max_slots:
            raise ValueError(f"{slots} rows requested, the cache holds at most {self.max_slots}")
        if length > self.max_positions:
            raise ValueError(f"{length} positions requested, the model allows {self.max_positions}")
        new_slots = self.slots if slots <= self.slots else min(self.max_slots, max(slots, 2 * self.slots, self.init_slots))
        new_cap = self.capacity if length <= self.capacity else min(
            self.max_positions, max(length, 2 * self.capacity, self.init_capacity))
        shape = (new_slots, self.n_kv, new_cap, self.head_dim)
        old_s, old_c = self.slots, self.capacity
        for store in (self.k, self.v):
            for i in range(len(self.layers)):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old_s:
                    t[:old_s, :, :old_c] = store[i]
                if i < len(store):
                    store[i] = t
                else:
                    store.append(t)
        self.slots, self.capacity = new_slots, new_cap

    def move_rows(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy rows ``src`` onto rows ``dst`` (the first ``length`` positions)."""
        if not dst or not self.slots:
            return
        d = torch.tensor(dst, device=self.device)
        s = torch.tensor(src, device=self.device)
        length = min(length, self.capacity)
        for store in (self.k, self.v):
            for t in store:
                t[d, :, :length] = t[s, :, :length]

    # shared pieces -----------------------------------------------------------
    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._final_norm(h)).float()

    # decode ------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """One step for rows ``0..n-1``: feed ``tokens[i]`` at position ``lengths[i]``.

        ``lengths[i]`` is how many positions row ``i`` holds in the cache; the
        new token's K/V are written there. ``max_len`` is ``max(lengths) + 1``.
        Returns float32 logits ``[n, vocab]`` for the next tokens.
        """
        n = tokens.shape[0]
        self.ensure(n, max_len)
        nh, nkv, hd, g, L = self.n_heads, self.n_kv, self.head_dim, self.groups, max_len
        h = self.embed(tokens)  # [n, hidden]
        cos, sin = self.rotary(h, lengths[:, None])  # [n, 1, head_dim]
        # rotate_half(x) * sin == roll(x, hd/2) * (sin with its first half negated)
        sin = sin * self._rope_sign
        valid = self._positions[:L][None, :] <= lengths[:, None]  # [n, L]
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, _NEG_INF)
        mask = mask[:, None, None, :].expand(n, nkv, 1, L).reshape(n * nkv, 1, L)
        # flat row of each (sequence, kv head, position) in a cache tensor viewed as [-1, head_dim]
        slot = torch.arange(n * nkv, device=self.device).view(n, nkv) * self.capacity
        write = (slot + lengths[:, None]).view(-1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = self._norms[i][0](h)
            qk = torch.cat((attn.q_proj(x).view(n, nh, hd), attn.k_proj(x).view(n, nkv, hd)), dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
            kc, vc = self.k[i], self.v[i]
            kc.view(-1, hd).index_copy_(0, write, qk[:, nh:].reshape(n * nkv, hd))
            vc.view(-1, hd).index_copy_(0, write, attn.v_proj(x).view(n * nkv, hd))
            q = qk[:, :nh].reshape(n * nkv, g, hd)
            keys = kc[:n, :, :L].reshape(n * nkv, L, hd)
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scale)  # [n*kv, g, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            o = torch.bmm(probs, vc[:n, :, :L].reshape(n * nkv, L, hd)).view(n, nh * hd)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(self._norms[i][1](h))
        return self.lm_head(self._final_norm(h)).float()

    # prefill -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Run ``seqs`` (right-padded together) and write their K/V into cache ``rows``.

        Returns float32 logits ``[m, vocab]`` at each sequence's last position.
        The caller must have made room with :meth:`ensure`.
        """
        m = len(seqs)
        lens = [len(s) for s in seqs]
        L = max(lens)
        ids = torch.zeros((m, L), dtype=torch.long, device=self.device)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
        lens_t = torch.tensor(lens, device=self.device)
        row_t = torch.tensor(rows, device=self.device)
        pos = torch.arange(L, device=self.device)
        h = self.embed(ids)  # [m, L, hidden]
        cos, sin = self.rotary(h, pos[None, :])
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, L, head_dim]
        padding = pos[None, None, :] >= lens_t[:, None, None]  # [m, 1, L]: keys past each sequence's end
        nh, nkv, hd, g = self.n_heads, self.n_kv, self.head_dim, self.groups
        # queries per chunk so that the scores stay under attn_chunk_bytes
        chunk = max(1, self.attn_chunk_bytes // max(1, m * nh * L * 4))
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = self._norms[i][0](h)
            q = self._rope(attn.q_proj(x).view(m, L, nh, hd).transpose(1, 2), cos, sin)
            k = self._rope(attn.k_proj(x).view(m, L, nkv, hd).transpose(1, 2), cos, sin)
            v = attn.v_proj(x).view(m, L, nkv, hd).transpose(1, 2)
            self.k[i][row_t, :, :L] = k
            self.v[i][row_t, :, :L] = v
            qg = (q * self.scale).reshape(m, nkv, g, L, hd)
            kt = k[:, :, None].transpose(-1, -2)  # [m, kv, 1, hd, L]
            vg = v[:, :, None]  # [m, kv, 1, L, hd]
            outs = []
            for c0 in range(0, L, chunk):
                c1 = min(L, c0 + chunk)  # keys past c1 are in the future of these queries
                hidden = (pos[None, :c1] > pos[c0:c1, None])[None] | padding[..., :c1]  # [m, c, c1]
                s = torch.matmul(qg[:, :, :, c0:c1], kt[..., :c1]).float()
                s.masked_fill_(hidden[:, None, None], _NEG_INF)
                p = torch.softmax(s, dim=-1).to(self.dtype)
                outs.append(torch.matmul(p, vg[:, :, :, :c1]))
            o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)  # [m, kv, g, L, hd]
            o = o.reshape(m, nh, L, hd).transpose(1, 2).reshape(m, L, nh * hd)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(self._norms[i][1](h))
        last = h[torch.arange(m, device=self.device), lens_t - 1]  # [m, hidden]
        return self._logits(last)
