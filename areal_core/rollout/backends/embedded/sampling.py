"""Per-request state (settings, outputs, response) and batched per-row sampling.

Sampling: temperature, top-k, top-p, optional per-request seeds (``sampling_params.sampling_seed``).

Behaviour logprob (what the trainer uses as the old policy's logprob): for a
sampled token ``t`` it is its logprob under the distribution it was drawn from:
``log_softmax(logits / temperature)`` restricted to the tokens top-k/top-p keep and
renormalised over them (without filtering, the full temperature-scaled distribution).
For temperature 0 (greedy) it is ``log_softmax(logits)[t]``, unfiltered. The trainer
recomputes logprobs over the full distribution, so RL refuses filtering
(``rollout.sampling``, see ``rollout/config.py``); evaluation may filter.

Drawing: inverse CDF with ONE uniform per row (not one per vocabulary entry, which costs
as much as the model's LM head at a 50k vocabulary): ``probs = exp(logp)`` (filtered tokens
have 0; unfiltered, ``softmax(logits / temperature)``, whose log at the token drawn is its
behaviour logprob), ``cdf = cumsum(probs)`` in float64, ``u ~ Uniform[0, 1)``, and the token is the
first index with ``cdf > u * cdf[-1] * (1 - 2^-52)``. A token of probability 0 can never be drawn
(its cdf equals its predecessor's) and the target stays strictly below ``cdf[-1]``.
A row with a seed (``sampling_seed``) draws the uniform for its output token at absolute position
``pos`` (prompt tokens included) from a counter-based hash, ``keyed_uniform(seed, pos)``: not
from a stream it consumes. So a seeded answer's tokens depend only on the logits at each
position and its seed: not on which other requests ran beside it, nor on whether it was
continued from a prefix (after a weight update's re-prefill, or on another server after its
first one died). Rows without a seed draw from the engine's generator. Above ``4 * CDF_BLOCK`` tokens the
cdf is found in two levels, which avoids a float64 scan of the whole vocabulary (a tenth of
SmolLM2-135M's decode step at batch 64): float32 sums of blocks of ``CDF_BLOCK`` tokens, their
float64 cumulative sum picks the block, and a float64 scan of that block alone picks the token;
the same token as the one-level scan unless the target falls within the block sums' float32
rounding (about 1e-7 of a block's mass) of a block's edge.
"""

from __future__ import annotations

import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import pydantic
import torch

from areal_core.rollout.protocol import FinishReason, GenerateResponse, MetaInfo, SamplingParams

_NEG_INF = float("-inf")
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_BELOW_ONE = 1.0 - 2.0**-52
CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF (see the module docstring)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scrambles every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """A request seed's 64-bit stream key (what :func:`keyed_uniform` combines with a position)."""
    return _mix64((seed + _GOLDEN) & _M64)


def keyed_uniform(key: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (``key``, ``position``): 53 bits of
    ``mix64(key + (position + 1) * golden)``, SplitMix64's output for the key's stream at that
    counter. Plain integer arithmetic: the same on every machine and device."""
    return (_mix64((key + (position + 1) * _GOLDEN) & _M64) >> 11) * 2.0**-53


class RequestError(ValueError):
    """A request the engine refuses (the server answers 400)."""


@dataclass(frozen=True, slots=True)
class RowSampling:
    temperature: float
    top_p: float
    top_k: int  # 0: off
    key: int | None  # stream_key of the request's seed (keyed_uniform), else None: the engine's generator


class BatchSampler:
    """Sampling settings of a fixed list of rows, turned into tensors once."""

    def __init__(
        self,
        rows: list[RowSampling],
        vocab_size: int,
        default_generator: torch.Generator,
        device: torch.device | str = "cpu",
    ):
        """``device``: where the logits are. Uniforms are drawn on the CPU (a seeded row's is plain
        integer arithmetic, so a seed gives the same answer on any device) and moved there."""
        self.n = len(rows)
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.default_generator = default_generator
        greedy = [r.temperature == 0 for r in rows]
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        self.greedy = torch.tensor(greedy, dtype=torch.bool, device=device)
        temps = [1.0 if g else r.temperature for g, r in zip(greedy, rows)]
        self.unit_temp = all(t == 1.0 for t in temps)
        self.temps = torch.tensor(temps, dtype=torch.float32, device=device)[:, None]
        ks = [r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows]
        self.use_top_k = any(k < vocab_size for k in ks)
        self.top_k = torch.tensor(ks, dtype=torch.long, device=device)[:, None]
        self.use_top_p = any(r.top_p < 1.0 for r in rows)
        self.top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)[:, None]
        self.seeded = [(i, r.key) for i, r in enumerate(rows) if r.key is not None]
        self._positions: list[int] | None = None

    def _filtered(self, logp: torch.Tensor) -> torch.Tensor:
        """``logp`` with tokens outside each row's top-k / top-p nucleus set to -inf."""
        if self.use_top_p:
            sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        else:  # top-k only: the largest k of the batch is enough
            sorted_lp, order = torch.topk(logp, int(self.top_k.max()), dim=-1)
        if self.use_top_k:
            ranks = torch.arange(sorted_lp.shape[-1], device=sorted_lp.device)[None, :]
            sorted_lp = sorted_lp.masked_fill(ranks >= self.top_k, _NEG_INF)
        if self.use_top_p:  # nucleus over the (renormalised) top-k survivors
            probs = torch.softmax(sorted_lp, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
            sorted_lp = sorted_lp.masked_fill(before > self.top_p, _NEG_INF)
        return torch.full_like(logp, _NEG_INF).scatter_(-1, order, sorted_lp)

    def _uniform(self) -> torch.Tensor:
        """float64 ``[n, 1]`` uniforms in [0, 1); seeded rows get theirs from their key and the
        position of the token being drawn (``sample``'s ``positions``)."""
        if len(self.seeded) == self.n:
            u = torch.tensor([[keyed_uniform(k, self._positions[i])] for i, k in self.seeded], dtype=torch.float64)
        else:
            u = torch.rand((self.n, 1), generator=self.default_generator, dtype=torch.float64)
            for i, k in self.seeded:
                u[i, 0] = keyed_uniform(k, self._positions[i])
        return u if self.device.type == "cpu" else u.to(self.device)

    def _draw_from(self, weights: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draw from unnormalised ``weights [n, V] >= 0``: tokens ``[n, 1]``. The token is
        the first whose cdf exceeds ``u * total``, the target kept strictly below the (float64) total
        (u < 1 and total * (1 - 2^-52) < total)."""
        n, V = weights.shape
        B = CDF_BLOCK
        if V <= 4 * B:
            cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
            total = cdf[:, -1:]
            return torch.searchsorted(cdf, self._uniform().mul_(total * _BELOW_ONE), right=True)
        full = V // B * B
        sums = weights[:, :full].reshape(n, V // B, B).sum(-1)  # in float32: a float64 copy costs 10x the sums
        if full < V:
            sums = torch.cat((sums, weights[:, full:].sum(-1, keepdim=True)), 1)
        cdf = torch.cumsum(sums, dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        target = self._uniform().mul_(total * _BELOW_ONE)
        block = torch.searchsorted(cdf, target, right=True)  # its cdf passes the target; its sum is > 0
        before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
        idx = block * B + torch.arange(B, device=weights.device)
        inner = torch.cumsum(weights.gather(1, idx.clamp(max=V - 1)).double().masked_fill_(idx >= V, 0.0), dim=-1)
        rest = torch.minimum(target - before, inner[:, -1:] * _BELOW_ONE)  # in [0, the block's sum)
        return block * B + torch.searchsorted(inner, rest, right=True)

    def _draw(self, logp: torch.Tensor) -> torch.Tensor:
        """One token per row from the distribution ``exp(logp)``."""
        return self._draw_from(logp.exp())[:, 0]

    def sample(self, logits: torch.Tensor, positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``logits [n, vocab]`` -> (tokens ``[n]`` long, behaviour logprobs ``[n]`` float32).
        ``positions``: each row's absolute position of the token drawn (needed with seeded rows)."""
        if self.seeded and (positions is None or len(positions) != self.n):
            raise ValueError("seeded rows need the position of each row's next token")
        self._positions = positions
        logits = logits[:, : self.vocab_size]
        if self.all_greedy:
            tokens = torch.argmax(logits, dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            return tokens, logp.gather(-1, tokens[:, None])[:, 0]
        scaled = logits if self.unit_temp else logits / self.temps
        if not (self.use_top_k or self.use_top_p):
            return self._sample_full(logits, scaled)
        logp = torch.log_softmax(scaled, dim=-1)
        kept = self._filtered(logp)
        tokens = self._draw(kept)
        # renormalised over the kept tokens: the logprob of the distribution drawn from
        behav = kept.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(kept, dim=-1)
        if self.any_greedy:  # greedy rows (scaled by 1): argmax, and the unfiltered log_softmax(logits)
            tokens = torch.where(self.greedy, torch.argmax(logits, dim=-1), tokens)
            behav = torch.where(self.greedy, logp.gather(-1, tokens[:, None])[:, 0], behav)
        return tokens, behav

    def _sample_full(self, logits: torch.Tensor, scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No filtering: one ``softmax`` serves both the draw and the logprob ``log(p[t])`` (a token
        drawn has ``p > 0``). Its fused kernel took less than a separate ``exp`` alone on the CPUs
        measured (64 x 49,152 floats on one AVX-512 core: 1.3-1.6 ms against 1.9-2.4 ms)."""
        probs = torch.softmax(scaled, dim=-1)
        tokens = self._draw_from(probs)
        if self.any_greedy:
            tokens = torch.where(self.greedy[:, None], torch.argmax(logits, dim=-1, keepdim=True), tokens)
        return tokens[:, 0], probs.gather(-1, tokens)[:, 0].log_()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine: its settings and what it generated so far."""

    rid: str
    prompt: list[int]
    max_new: int
    stop: frozenset[int]  # stop_token_ids plus the model's EOS unless ignore_eos
    sampling: RowSampling
    return_logprob: bool
    future: Future
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cache_len: int = 0  # positions of this sequence held in the KV cache
    needs_prefill: bool = True
    finish: tuple[str, int | None] | None = None  # (finish type, matched stop token)

    def response(self, version: int) -> GenerateResponse:
        kind, matched = self.finish or ("abort", None)
        meta = MetaInfo(
            id=self.rid,
            finish_reason=FinishReason(type=kind, matched=matched),
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.out),
            output_token_logprobs=[(lp, t, None) for lp, t in zip(self.logprobs, self.out)]
            if self.return_logprob
            else [],
            output_token_versions=list(self.versions),
            weight_version=version,
        )
        return GenerateResponse(output_ids=list(self.out), meta_info=meta)


def new_sequence(
    input_ids: list[int],
    sampling: SamplingParams | dict | None,
    rid: str | None,
    return_logprob: bool,
    future: Future,
    *,
    vocab_size: int,
    max_positions: int,
    eos_ids: list[int],
) -> Sequence:
    """Check a request against the model and build its :class:`Sequence` (raises :class:`RequestError`)."""
    if not isinstance(sampling, SamplingParams):
        try:
            sampling = SamplingParams.model_validate(sampling or {})
        except pydantic.ValidationError as e:
            raise RequestError(f"bad sampling params: {e}") from None
    ids = list(input_ids)
    if not ids:
        raise RequestError("input_ids is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids hold {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]!r}")
    total = len(ids) + sampling.max_new_tokens
    if total > max_positions:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} exceeds "
            f"the model's context of {max_positions} positions"
        )
    seed = sampling.sampling_seed
    stop = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop.update(eos_ids)
    return Sequence(
        rid=rid if rid is not None else uuid.uuid4().hex,
        prompt=ids,
        max_new=sampling.max_new_tokens,
        stop=frozenset(stop),
        sampling=RowSampling(
            sampling.temperature, sampling.top_p, sampling.top_k, None if seed is None else stream_key(seed)
        ),
        return_logprob=return_logprob,
        future=future,
    )
