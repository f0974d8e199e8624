"""Batched forward passes with a KV cache over a Hugging Face causal LM (Llama / Qwen2 layout).

The model's parameters are the source of truth; this module runs its own lean forward
over *fused* copies of some of them, built by :meth:`KVForward.weights_changed`:

* per layer, one ``[(groups + 2) * kv_heads * head_dim, hidden]`` projection for q, k and v,
  rows ordered per kv head ``j`` as ``[q heads of group j, k_j, v_j]``: the rotary embedding
  then applies to one strided view, and one indexed copy writes every ``k_j`` and ``v_j`` to the cache;
* per layer, one ``[2 * intermediate, hidden]`` projection for gate and up;
* in float32, each layer's two RMSNorm weights folded into the projection that follows;
* in bfloat16 on a CPU (``onednn.packable``): every projection's weight packed once for oneDNN
  (:class:`PackedLayer`, and the LM head), the residual adds and the MLP's SiLU-times-up done in
  the products' epilogues (``onednn``), except in batch-invariant mode.

Whoever changes the model's weights (in place or by replacing parameters) must call
:meth:`KVForward.weights_changed` before the next forward. The KV cache does not depend
on the weights and is left as it is.

Cache layout: per layer one tensor ``[2, slots, kv_heads, capacity, head_dim]`` (every row's keys,
then every row's values, each head's over consecutive positions), plus one additive mask ``[slots,
kv_heads, capacity]`` (0 where a position holds a token, -inf elsewhere) shared by the layers. Decode
attention reads the keys in its score product and the values in its value product: apart, each
is one block of memory, where keys and values interleaved position by position made each product
pull the other's cache lines too (docs/PERFORMANCE.md, "Where a decode step goes"). Row ``i``
belongs to the ``i``-th running sequence; the caller keeps them compacted in rows ``0..n-1`` (:meth:`KVForward.move_rows`).
Grouped-query attention views the queries as ``[n * kv_heads, groups, head_dim]``, so K/V
heads are never repeated in memory.

Decode attention over the whole capacity, in place: the keys (and the values) of rows ``0..n-1``
over all ``capacity`` positions are one contiguous ``[n * kv_heads, capacity, head_dim]`` block,
which the bfloat16 batched products take as they are, where over the first ``L`` positions only
(rows ``capacity`` positions apart) they copy it first. Positions no row holds are masked (-inf,
their cache zeros or a moved row's stale, finite values), so reading them changes no result but
costs their reads; the three-call bfloat16 attention takes the whole capacity where it is at most
:data:`IN_PLACE_WIDENING` times the positions the longest row needs (:meth:`KVForward._in_place`).
Where it may, a capacity that a row outgrows grows by that same factor (elsewhere it doubles), so
once the cache has grown it is always read in place: growing by 1.25 copies the cache about every
fifth of its positions instead of at every doubling (over a long answer about three times the
bytes, each growth about what two decode steps' attention reads), and a growth holds 2.25 times
the old cache at its peak instead of 3. The initial capacity (or a KV budget's reservation) can
still exceed it.
On an Intel Xeon with AMX (SmolLM2 at batch 64, one thread, the forward a decode step), with the
capacity about 1.2 times the positions needed, reading it in place was 1.6, 4.5, 9 and 12.5 % faster
at 48, 96, 192 and 384 positions; at 1.5 times it was level at 256 positions and slower below.

Decode attention is one fused flash-attention call (``F.scaled_dot_product_attention``, torch's
CPU flash kernel): the ``groups`` query heads that share a KV head enter as that head's query
rows, unmasked between them, over the cached positions the mask leaves; it keeps the softmax and
the weighted sum in float32 and reads K and V in place. Over a cache the CPU holds it takes about
half the time of a score product, a softmax and a value product; inside a step, where each layer's
cache comes from memory, less is gained (``python -m bench decode_parts``, SmolLM2 at batch 64:
float32 attention 27.2 -> 20.1 ms a step on an Intel Xeon with AMX, 23.3 -> 19.4 on an AMD EPYC
with AVX-512 BF16). In bfloat16 on a CPU the fused call is the slower way, with AMX tiles or without
(on an AMD EPYC with AVX-512 BF16 16.3 ms a step against 26.3; on an Intel Xeon with AMX, since the
score product takes the queries first over a copy of the keys (:meth:`KVForward._scores`), 14.1
against 22.2), so bfloat16 decode attention on a CPU takes the three calls
(:func:`fused_decode_attention`).

Decode attention in two parts when lengths differ a lot: continuous batching nearly always
holds a few long sequences among many short ones, and one batched attention call reads every
row up to the longest. When it saves at least half of that (:meth:`KVForward._split_at`),
all rows attend to the first ``Ls`` positions (a view of the cache) and only the rows longer
than that to the rest (a gathered copy); the two partial softmaxes are merged by their maxima
and sums, as split-K attention kernels do.

Batch-invariant mode (``batch_invariant``): each sequence's arithmetic does not depend on the
sequences beside it, so its logits are bit for bit the same alone or in any batch. CPU GEMM
kernels pick their code path by the number of rows (on the machines measured: one row, two or
three, four and more, each rounding differently), so every projection's rows are padded to at
least ``INVARIANT_MIN_ROWS``; decode attention reads every row to a multiple of
``INVARIANT_BLOCK`` positions (trailing masked positions then add exact zeros), is never split,
and takes at most ``INVARIANT_MAX_QUERY_ROWS`` query heads per call (above that the kernels'
summation order followed the length); prefill attention runs per sequence over its own length
(its projections stay batched). ``tests/unit/test_batch_invariance.py`` checks it on the
machine that runs it; docs/PERFORMANCE.md gives its cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_core.models.decoder import apply_rope, rope_table
from areal_core.models.weights import (  # noqa: F401 - re-exported: the engine's imports
    UnsupportedModelError,
    apply_weights,
    check_supported,
    eos_token_ids,
    load_model,
    read_weights,
)
from areal_core.rollout.backends.embedded import onednn

_NEG_INF = float("-inf")
INVARIANT_MIN_ROWS = 16  # batch-invariant mode: projections see at least this many rows
INVARIANT_BLOCK = 64  # batch-invariant mode: decode attention spans a multiple of this many positions
INVARIANT_MAX_QUERY_ROWS = 3  # batch-invariant mode: decode attention's query heads per call, at most
_STANDARD_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")
# decode attention reads the whole capacity in place where it is at most this many times the positions
# the longest row needs (the module docstring)
IN_PLACE_WIDENING = 1.25


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)``: an RMSNorm whose weight was folded into the next projection."""
    return F.rms_norm(x, x.shape[-1:], None, eps)


@dataclass(slots=True)
class FusedLayer:
    """One decoder layer's weights as the lean forward uses them (see the module docstring)."""

    norm1: object  # callable: x -> normed x (weight folded into qkv when ``folded``)
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor  # o_proj.weight.t()
    o_bias: torch.Tensor | None
    norm2: object
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_t: torch.Tensor  # down_proj.weight.t()
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class PackedLayer:
    """One decoder layer's weights packed for oneDNN (``onednn.pack``), bfloat16 on a CPU; the qkv
    projection fused as in :class:`FusedLayer`, gate and up apart (SiLU goes in the gate's epilogue)."""

    norm1: object
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: object
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def fused_decode_attention(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode attention runs as one fused flash-attention call (else a score product, a
    softmax and a value product): everywhere but in bfloat16 on a CPU, where torch's flash kernel is
    the slower way with AMX tiles and without (the module docstring)."""
    return device.type != "cpu" or dtype != torch.bfloat16


def _bias(linear: torch.nn.Linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else torch.zeros_like(linear.weight[:, 0])


def _standard(norm: torch.nn.Module, dtype: torch.dtype) -> bool:
    """A standard RMSNorm (weight times ``x * rsqrt(mean(x^2) + eps)``) holding ``dtype`` weights: one of
    the Hugging Face classes named, or a :class:`~areal_core.models.decoder_weights.RMSNorm` that says so."""
    known = type(norm).__name__ in _STANDARD_NORMS or getattr(norm, "standard", False)
    return known and norm.weight.dtype == dtype


def _foldable(norm: torch.nn.Module, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and _standard(norm, dtype)


def _one_call(norm: torch.nn.Module, dtype: torch.dtype):
    """``norm`` as one fused ``F.rms_norm`` call where it is a standard RMSNorm holding ``dtype``
    weights, else the module. The module makes a float32 copy of the rows and passes over it once per
    operation (square, mean, scale, round, weight); the fused call reads the rows once and rounds
    once, after the weight, where the module rounds before it too (so a value can differ in its last place)."""
    if not _standard(norm, dtype):
        return norm
    w, eps = norm.weight, norm.variance_epsilon
    return lambda x: F.rms_norm(x, x.shape[-1:], w, eps)


class KVForward:
    """Prefill and decode over a model with a compacted, growable KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_slots: int,
        init_slots: int = 8,
        init_capacity: int = 256,
        attn_chunk_bytes: int = 64 << 20,
        batch_invariant: bool = False,
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
            raise UnsupportedModelError(
                f"{cfg.model_type}: {self.n_heads} heads do not group over {self.n_kv} kv heads"
            )
        self.groups = self.n_heads // self.n_kv
        self.scale = self.head_dim**-0.5
        self.max_positions = int(cfg.max_position_embeddings)
        self.vocab_size = self.embed.num_embeddings
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.act = F.silu if getattr(cfg, "hidden_act", None) == "silu" else self.layers[0].mlp.act_fn
        self.max_slots = max_slots
        self.init_slots = max(1, min(init_slots, max_slots))
        self.init_capacity = max(1, min(init_capacity, self.max_positions))
        self.attn_chunk_bytes = attn_chunk_bytes
        self.split_min_positions = 8192  # decode attention is split only above this many padded positions
        self.batch_invariant = batch_invariant
        self.packed = onednn.packable(self.dtype, self.device) and not batch_invariant
        # decode attention in one flash-attention call, else three (benchmarks set it)
        self.fused_attention = fused_decode_attention(self.dtype, self.device)
        # decode scores as q . keys^T over a copy of the keys, else keys . q^T (:meth:`_scores`; benchmarks
        # set it): where oneDNN runs the bfloat16 products, as for packing
        self.query_first_scores = self.packed
        # bfloat16 decode attention over the whole capacity in place (:meth:`_in_place`; benchmarks set it)
        self.attend_in_place = self.packed
        # how much the capacity grows when a row outgrows it (:meth:`ensure`): where attention reads the
        # whole capacity, by IN_PLACE_WIDENING, so that it always may; else it doubles (benchmarks set it)
        self.capacity_growth = IN_PLACE_WIDENING if self.attend_in_place else 2.0
        self._rope = torch.empty(0, 2, self.head_dim, dtype=self.dtype, device=self.device)
        self.fused: list[FusedLayer | PackedLayer] = []
        self.weights_changed()
        self.release()

    # weights -----------------------------------------------------------------
    @torch.no_grad()
    def weights_changed(self) -> None:
        """Rebuild the fused weights from the model's current parameters.

        Call after any change to the model's weights (``apply_weights``, ``load_state_dict``,
        parameters replaced). Cheap next to a weight load; the KV cache is kept.
        """
        self.fused = [self._pack(layer) if self.packed else self._fuse(layer) for layer in self.layers]
        self._lm_head = onednn.pack(self.lm_head.weight) if self.packed else None
        self._final_norm = _one_call(self.norm, self.dtype)

    def _qkv_weights(self, attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused q/k/v projection's weight and bias (rows per kv head, see the module docstring)."""
        kv, g, hd = self.n_kv, self.groups, self.head_dim
        lin = (attn.q_proj, attn.k_proj, attn.v_proj)
        per_group = [t.view(kv, -1, *t.shape[1:]) for t in (x.weight for x in lin)]  # [kv, g*hd | hd, hidden]
        qkv = torch.cat(per_group, dim=1).reshape(kv * (g + 2) * hd, -1)
        qkv_bias = None
        if any(x.bias is not None for x in lin):
            qkv_bias = torch.cat([_bias(x).view(kv, -1) for x in lin], dim=1).reshape(-1)
        return qkv, qkv_bias

    def _fuse(self, layer: torch.nn.Module) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = self._qkv_weights(attn)
        gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
        gate_up_bias = None
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            gate_up_bias = torch.cat((_bias(mlp.gate_proj), _bias(mlp.up_proj)))
        norms = []
        for norm, w in ((layer.input_layernorm, "qkv"), (layer.post_attention_layernorm, "gate_up")):
            if _foldable(norm, self.dtype):
                if w == "qkv":
                    qkv = qkv * norm.weight
                else:
                    gate_up = gate_up * norm.weight
                eps = norm.variance_epsilon
                norms.append(lambda x, eps=eps: _rms(x, eps))
            else:
                norms.append(_one_call(norm, self.dtype))
        return FusedLayer(
            norms[0],
            qkv.contiguous(),
            qkv_bias,
            attn.o_proj.weight.t(),
            attn.o_proj.bias,
            norms[1],
            gate_up.contiguous(),
            gate_up_bias,
            mlp.down_proj.weight.t(),
            mlp.down_proj.bias,
        )

    def _pack(self, layer: torch.nn.Module) -> PackedLayer:
        """``layer`` as a :class:`PackedLayer`; its norms are not folded (bfloat16 norm weights never are)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = self._qkv_weights(attn)
        return PackedLayer(
            _one_call(layer.input_layernorm, self.dtype),
            onednn.pack(qkv),
            qkv_bias,
            onednn.pack(attn.o_proj.weight),
            attn.o_proj.bias,
            _one_call(layer.post_attention_layernorm, self.dtype),
            onednn.pack(mlp.gate_proj.weight),
            mlp.gate_proj.bias,
            onednn.pack(mlp.up_proj.weight),
            mlp.up_proj.bias,
            onednn.pack(mlp.down_proj.weight),
            mlp.down_proj.bias,
        )

    def _qkv(self, f: FusedLayer | PackedLayer, h: torch.Tensor) -> torch.Tensor:
        """The fused q, k, v projection of ``norm1(h)`` (2-D)."""
        if self.packed:
            return onednn.linear(f.norm1(h), f.qkv, f.qkv_bias)
        return self._linear(f.norm1(h), f.qkv, f.qkv_bias)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` over the rows of 2-D ``x``; batch-invariant: over at least INVARIANT_MIN_ROWS rows."""
        n = x.shape[0]
        if not self.batch_invariant or n >= INVARIANT_MIN_ROWS:
            return F.linear(x, w, b)
        return F.linear(F.pad(x, (0, 0, 0, INVARIANT_MIN_ROWS - n)), w, b)[:n]

    def _add_matmul(self, h: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor) -> None:
        """``h += x @ w_t`` in place (2-D); batch-invariant: the product over padded rows, then added."""
        if not self.batch_invariant:
            h.addmm_(x, w_t)
        else:
            h.add_(self._linear(x, w_t.t()))

    def _mlp(self, f: FusedLayer | PackedLayer, h: torch.Tensor) -> torch.Tensor:
        """``h + mlp(norm2(h))`` (2-D): in place into ``h``, or a new tensor where packed."""
        if self.packed:
            x = f.norm2(h)
            gated = onednn.linear_mul(x, onednn.linear_silu(x, f.gate, f.gate_bias), f.up, f.up_bias)
            return onednn.linear_add(gated, h, f.down, f.down_bias)
        gu = self._linear(f.norm2(h), f.gate_up, f.gate_up_bias)
        half = gu.shape[-1] // 2
        self._add_matmul(h, self.act(gu[:, :half]).mul_(gu[:, half:]), f.down_t)
        if f.down_bias is not None:
            h.add_(f.down_bias)
        return h

    def _out_proj(self, f: FusedLayer | PackedLayer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """``h + o_proj(o)`` (both 2-D): in place into ``h``, or a new tensor where packed."""
        if self.packed:
            return onednn.linear_add(o, h, f.o, f.o_bias)
        self._add_matmul(h, o, f.o_t)
        if f.o_bias is not None:
            h.add_(f.o_bias)
        return h

    # cache management ------------------------------------------------------
    def release(self) -> None:
        self.kv: list[torch.Tensor] = []
        self.mask = torch.empty(0, self.n_kv, 0, dtype=self.dtype, device=self.device)
        self.slots = self.capacity = 0
        self._row_base = torch.empty(0, self.n_kv, dtype=torch.long, device=self.device)

    def ensure(self, slots: int, length: int) -> None:
        """Make room for ``slots`` rows of ``length`` positions, keeping the contents. Rows double;
        the capacity grows by ``capacity_growth`` (at least to ``length``) when ``length`` exceeds it."""
        if slots <= self.slots and length <= self.capacity:
            return
        if slots > self.max_slots:
            raise ValueError(f"{slots} rows requested, the cache holds at most {self.max_slots}")
        if length > self.max_positions:
            raise ValueError(f"{length} positions requested, the model allows {self.max_positions}")
        new_slots = (
            self.slots if slots <= self.slots else min(self.max_slots, max(slots, 2 * self.slots, self.init_slots))
        )
        new_cap = (
            self.capacity
            if length <= self.capacity
            else min(
                self.max_positions, max(length, math.ceil(self.capacity_growth * self.capacity), self.init_capacity)
            )
        )
        old_s, old_c = self.slots, self.capacity
        # what is not copied is zeroed: masked positions still enter the matmuls and must be finite
        shape = (2, new_slots, self.n_kv, new_cap, self.head_dim)
        for i in range(len(self.layers)):
            t = torch.empty(shape, dtype=self.dtype, device=self.device)
            if old_s:
                t[:, :old_s, :, :old_c] = self.kv[i][:, :old_s, :, :old_c]
                t[:, :old_s, :, old_c:] = 0
            t[:, old_s:] = 0
            if i < len(self.kv):
                self.kv[i] = t
            else:
                self.kv.append(t)
        mask = torch.full((new_slots, self.n_kv, new_cap), _NEG_INF, dtype=self.dtype, device=self.device)
        mask[:old_s, :, :old_c] = self.mask
        self.mask = mask
        self.slots, self.capacity = new_slots, new_cap
        # flat index of (slot, kv head, position 0) in the mask, and of its key in a cache tensor viewed
        # as [-1, head_dim]; its value lies ``_values_at`` rows further
        self._row_base = torch.arange(new_slots * self.n_kv, device=self.device).view(new_slots, self.n_kv) * new_cap
        self._values_at = new_slots * self.n_kv * new_cap
        if self._rope.shape[0] < new_cap:
            self._rope = self._rope_table(new_cap)

    def _rope_table(self, n: int) -> torch.Tensor:
        return rope_table(self.rotary, torch.arange(n, device=self.device), self.dtype)

    def move_rows(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy rows ``src`` onto rows ``dst`` (the first ``length`` positions; the mask entirely)."""
        if not dst or not self.slots:
            return
        d = torch.tensor(dst, device=self.device)
        s = torch.tensor(src, device=self.device)
        length = min(length, self.capacity)
        for t in self.kv:
            t[:, d, :, :length] = t[:, s, :, :length]
        self.mask[d] = self.mask[s]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        x = self._final_norm(h)
        if self.packed:
            return onednn.linear(x, self._lm_head, self.lm_head.bias).float()
        if self.batch_invariant:
            return self._linear(x, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(x).float()

    # decode ------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """One step for rows ``0..n-1``: feed ``tokens[i]`` at position ``lengths[i]``.

        ``lengths[i]`` is how many positions row ``i`` holds in the cache; the
        new token's K/V are written there. ``max_len`` is ``max(lengths) + 1``.
        Returns float32 logits ``[n, vocab]`` for the next tokens.
        """
        n = tokens.shape[0]
        if self.batch_invariant:  # every row over a multiple of the block (at most the model's context)
            max_len = min(self.max_positions, -(-max_len // INVARIANT_BLOCK) * INVARIANT_BLOCK)
        self.ensure(n, max_len)
        kv, g, hd, L = self.n_kv, self.groups, self.head_dim, max_len
        h = F.embedding(tokens, self.embed.weight)  # [n, hidden]
        rope = self._rope[lengths]  # [n, 2, hd]
        cos, sin = rope[:, None, None, 0], rope[:, None, None, 1]  # [n, 1, 1, hd]
        write = self._row_base[:n] + lengths[:, None]  # [n, kv]: the new position in the mask and the cache
        self.mask.view(-1).index_fill_(0, write.view(-1), 0.0)
        kv_write = torch.stack((write, write + self._values_at), dim=-1).view(-1)  # [n * kv * 2]
        split = None if self.batch_invariant else self._split_at(lengths, L)
        if split is not None:
            Ls, long_rows = split
            L = Ls
        elif self._in_place(L):
            L = self.capacity
        mask = self.mask.view(-1, 1, self.capacity)[: n * kv, :, :L]  # [n*kv, 1, L]
        for f, cache in zip(self.fused, self.kv):
            y = self._qkv(f, h).view(n, kv, g + 2, hd)
            apply_rope(y[:, :, : g + 1], cos, sin, inplace=True)  # the queries and the key
            cache.view(-1, hd).index_copy_(0, kv_write, y[:, :, g:].reshape(n * kv * 2, hd))
            keys = cache[0, :n, :, :L].reshape(n * kv, L, hd)  # views
            values = cache[1, :n, :, :L].reshape(n * kv, L, hd)
            q = y[:, :, :g].reshape(n * kv, g, hd)
            if self.batch_invariant and g > INVARIANT_MAX_QUERY_ROWS:
                o = self._attention_by_head_chunks(mask, q, keys, values)
            elif split is None and self.fused_attention:
                o = self._fused_attention(mask, q, keys, values)
            elif split is None:
                o = self._attention(mask, q, keys, values)
            else:
                scores = self._scores(mask, q, keys)
                o = self._merged_attention(scores, values, q, cache, long_rows, Ls, max_len)
            h = self._mlp(f, self._out_proj(f, h, o.view(n, -1)))
        return self._logits(h)

    def _in_place(self, L: int) -> bool:
        """Whether decode attention over ``L`` positions reads the whole capacity in place instead (the
        module docstring): three-call bfloat16 attention outside batch-invariant mode, where the
        capacity is at most :data:`IN_PLACE_WIDENING` times ``L``."""
        return (
            self.attend_in_place
            and not self.fused_attention
            and not self.batch_invariant
            and self.capacity <= IN_PLACE_WIDENING * L
        )

    def _scores(self, mask, q, keys) -> torch.Tensor:
        """Scaled ``q [b, g, hd]`` . ``keys [b, L, hd]``, plus ``mask [b, 1, L]``: ``[b, g, L]``.

        ``keys`` is a view of the cache whose rows lie ``capacity`` positions apart (where it does not
        span the whole capacity, :meth:`_in_place`), which the batched
        bfloat16 product copies before it multiplies, whichever side it enters. In bfloat16 where
        oneDNN runs the products (``query_first_scores``: ``onednn.packable``, not in batch-invariant
        mode) the keys are copied explicitly and enter as the transposed right
        operand of q . keys^T: the scores come out contiguous, so the softmax reads its rows in order,
        and the product is faster. ``python -m bench decode_parts`` on an AMD EPYC with AVX-512 BF16
        (docs/PERFORMANCE.md): attention 15.7 against 18.2 ms a decode step of SmolLM2 at batch 64 and
        16-48 positions, and at 512 cached positions 136 against 170 ms, the forward 257 against 296.
        Float32 (torch's MKL path) keeps keys . q^T, ``[b, L, g]`` returned as a transposed view: the
        other way round was 7-11 % faster up to 48 positions and 10-12 % slower from 128 (a
        micro-benchmark over 30 layers' caches), and float32 decode attention is one fused call
        outside the split and batch-invariant mode anyway. Batch-invariant mode keeps it
        in every dtype (its summation order was checked that way), and so does bfloat16 on a CPU
        without AVX-512 (with AVX2 kernels emulated the other way was 0.4-7 % slower)."""
        if self.query_first_scores:
            return torch.baddbmm(mask, q, keys.contiguous().transpose(1, 2), alpha=self.scale)
        return torch.baddbmm(mask.transpose(1, 2), keys, q.transpose(1, 2), alpha=self.scale).transpose(1, 2)

    def _attention(self, mask, q, keys, values) -> torch.Tensor:
        """Softmax attention of ``q [n*kv, g, hd]`` over ``keys``/``values [n*kv, L, hd]``, ``mask [n*kv, 1, L]``."""
        probs = torch.softmax(self._scores(mask, q, keys), dim=-1, dtype=torch.float32).to(self.dtype)
        return torch.bmm(probs, values)

    def _fused_attention(self, mask, q, keys, values) -> torch.Tensor:
        """:meth:`_attention` as one fused flash-attention call: ``q``'s ``g`` query heads as the g query
        rows of one head per ``[n*kv]`` row (the module docstring)."""
        k, v = keys.unsqueeze(1), values.unsqueeze(1)
        return F.scaled_dot_product_attention(q.unsqueeze(1), k, v, attn_mask=mask.unsqueeze(1), scale=self.scale)[:, 0]

    def _attention_by_head_chunks(self, mask, q, keys, values) -> torch.Tensor:
        """:meth:`_attention` for at most INVARIANT_MAX_QUERY_ROWS query heads per call (batch-invariant mode)."""
        step = INVARIANT_MAX_QUERY_ROWS
        chunks = [self._attention(mask, q[:, j : j + step], keys, values) for j in range(0, q.shape[1], step)]
        return torch.cat(chunks, dim=1)

    def _split_at(self, lengths: torch.Tensor, L: int) -> tuple[int, torch.Tensor] | None:
        """Where to split the decode attention (see the module docstring): ``(Ls, long rows)``, or
        None when one call over ``[rows, L]`` costs less than twice the split's positions."""
        n = lengths.shape[0]
        if n * L < self.split_min_positions:
            return None
        desc = torch.sort(lengths + 1, descending=True).values  # positions each row attends to
        m = torch.arange(n, device=lengths.device)
        cost = n * desc + m * (L - desc)  # rows 0..m-1 long, the others up to desc[m]
        best = int(torch.argmin(cost[1:])) + 1  # at least one long row
        if 2 * int(cost[best]) > n * L:
            return None
        Ls = int(desc[best])
        return Ls, torch.nonzero(lengths + 1 > Ls)[:, 0]

    def _merged_attention(self, scores, values, q, cache, long_rows, Ls: int, L: int) -> torch.Tensor:
        """Softmax attention whose first ``Ls`` positions are ``scores``/``values`` (all rows) and whose
        positions ``Ls..L-1`` exist for ``long_rows`` only; ``[n*kv, g, hd]``."""
        kv, g, hd = self.n_kv, self.groups, self.head_dim
        top = scores.amax(dim=-1, keepdim=True).float()  # finite: every row holds position 0
        p = torch.exp(scores.float() - top)
        total = p.sum(dim=-1, keepdim=True)
        o = torch.bmm(p.to(self.dtype), values).float()  # unnormalised
        m = long_rows.shape[0]
        tail = cache[:, long_rows, :, Ls:L]  # [2, m, kv, L - Ls, hd], a copy
        tail_k, tail_v = (tail[i].reshape(m * kv, L - Ls, hd) for i in (0, 1))
        q2 = q.view(-1, kv, g, hd)[long_rows].reshape(m * kv, g, hd)
        mask2 = self.mask[long_rows, :, Ls:L].reshape(m * kv, 1, L - Ls)
        s2 = self._scores(mask2, q2, tail_k)
        top2 = s2.amax(dim=-1, keepdim=True).float()  # finite: a long row holds a position past Ls
        p2 = torch.exp(s2.float() - top2)
        sel = (long_rows[:, None] * kv + torch.arange(kv, device=long_rows.device)).reshape(-1)  # their [n*kv] rows
        new_top = torch.maximum(top[sel], top2)
        a, b = torch.exp(top[sel] - new_top), torch.exp(top2 - new_top)
        o[sel] = o[sel] * a + torch.bmm(p2.to(self.dtype), tail_v).float() * b
        total[sel] = total[sel] * a + p2.sum(dim=-1, keepdim=True) * b
        return (o / total).to(self.dtype)

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
        ids = torch.zeros((m, L), dtype=torch.long)  # filled on the CPU, moved in one copy
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(self.device)
        lens_t = torch.tensor(lens, device=self.device)
        row_t = torch.tensor(rows, device=self.device)
        pos = torch.arange(L, device=self.device)
        valid = pos[None, :] < lens_t[:, None]  # [m, L]
        self.mask[row_t] = torch.where(
            torch.arange(self.capacity, device=self.device) < lens_t[:, None], 0.0, _NEG_INF
        ).to(self.dtype)[:, None, :]
        h = F.embedding(ids, self.embed.weight).view(m * L, -1)
        cos, sin = self._rope[:L, None, None, 0], self._rope[:L, None, None, 1]  # [L, 1, 1, hd]
        kv, g, hd = self.n_kv, self.groups, self.head_dim
        hidden = (pos[None, :] > pos[:, None])[None] | ~valid[:, None, :]  # [m, L(query), L(key)]
        # queries per chunk so that the scores stay under attn_chunk_bytes
        chunk = max(1, self.attn_chunk_bytes // max(1, m * self.n_heads * L * 4))
        for f, cache in zip(self.fused, self.kv):
            y = self._qkv(f, h).view(m, L, kv, g + 2, hd)
            apply_rope(y[..., : g + 1, :], cos, sin, inplace=True)
            cache[:, row_t, :, :L] = y[..., g:, :].permute(3, 0, 2, 1, 4)  # [2, m, kv, L, hd]
            q = (y[..., :g, :] * self.scale).permute(0, 2, 3, 1, 4)  # [m, kv, g, L, hd]
            kt = y[..., g, :].permute(0, 2, 3, 1)[:, :, None]  # [m, kv, 1, hd, L]
            v = y[..., g + 1, :].transpose(1, 2)[:, :, None]  # [m, kv, 1, L, hd]
            if self.batch_invariant:  # each sequence's attention over its own length alone
                o = torch.zeros_like(q)
                for j, n in enumerate(lens):
                    o[j : j + 1, :, :, :n] = self._prefill_attention(
                        q[j : j + 1, :, :, :n],
                        kt[j : j + 1, ..., :n],
                        v[j : j + 1, :, :, :n],
                        hidden[j : j + 1, :n, :n],
                        max(1, self.attn_chunk_bytes // max(1, self.n_heads * n * 4)),
                    )
            else:
                o = self._prefill_attention(q, kt, v, hidden, chunk)
            h = self._mlp(f, self._out_proj(f, h, o.permute(0, 3, 1, 2, 4).reshape(m * L, -1)))
        last = h.view(m, L, -1)[torch.arange(m, device=self.device), lens_t - 1]  # [m, hidden]
        return self._logits(last)

    def _prefill_attention(self, q, kt, v, hidden, chunk: int) -> torch.Tensor:
        """Causal attention of ``q [m, kv, g, L, hd]`` over ``kt [m, kv, 1, hd, L]`` / ``v [m, kv, 1, L, hd]``
        (``hidden [m, L, L]``: True where a query may not look), ``chunk`` queries at a time."""
        L, outs = q.shape[3], []
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)  # keys past c1 are in the future of these queries
            s = torch.matmul(q[:, :, :, c0:c1], kt[..., :c1]).float()
            s.masked_fill_(hidden[:, None, None, c0:c1, :c1], _NEG_INF)
            p = torch.softmax(s, dim=-1).to(self.dtype)
            outs.append(torch.matmul(p, v[:, :, :, :c1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)  # [m, kv, g, L, hd]
