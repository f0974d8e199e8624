"""Off-policy corrections of the decoupled PPO objective: what replaces the behaviour weight.

The decoupled objective (``losses.py``) weights each token's clipped surrogate by its behaviour
importance weight ``w_t = pi_prox(a_t) / pi_behav(a_t)``, computed here as ``exp(log_w_t)`` with
``log_w_t = prox_logp_t - behav_logp_t``. A correction replaces ``w_t`` by a weight ``c_t``::

    loss_t = -c_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps) * A_t)

Every ``c_t`` is computed from detached log-probabilities, so no gradient flows through it. A
dropped ("masked") token has ``c_t = 0``; it still counts in the loss's denominator, as in
AReaL's cap and M2PO's objective (``1 / sum_i |o_i|``). The kinds (``trainer.off_policy.kind``):

========  =====================================================  ==============
kind      c_t                                                    acts on
========  =====================================================  ==============
none      w_t                                                    -
cap       w_t if w_t <= C else 0                                 tokens
tis       min(w_t, C)                                            tokens
mis       rho_s if rho_s <= C else 0, rho_s = prod_{t in s} w_t  sequences
geo_mask  w_t if lo <= exp(mean_{t in s} log w_t) <= hi else 0   sequences
icepop    w_t if lo <= w_t <= hi else 0                          tokens
m2po      w_t, or 0 for the tokens M2PO's rule drops             tokens (jointly)
========  =====================================================  ==============

A sequence ``s`` is one trajectory's answer: a row of ``[batch, T]`` inputs, or a run of
``seq_lens`` tokens of packed 1-D inputs. Only its valid (trained) tokens enter its ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field

from areal_core.configbase import Section

# the config of each kind (``trainer.off_policy``), a union tagged by ``kind``


class OffPolicyNone(Section):
    """The plain decoupled objective: each token weighted by w = pi_prox / pi_behav."""

    kind: Literal["none"] = "none"


class OffPolicyCap(Section):
    """Tokens with w > cap contribute 0 (AReaL's behaviour-weight cap)."""

    kind: Literal["cap"] = "cap"
    cap: float = Field(5.0, gt=1)  # C: the largest w a token may have and still count


class OffPolicyTIS(Section):
    """Token-level truncated importance sampling: each token weighted by min(w, cap)."""

    kind: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=1)  # C: the largest weight a token gets


class OffPolicyMIS(Section):
    """Sequence-level masked importance sampling: every token of a sequence weighted by the
    sequence's ratio rho = prod w over its trained tokens; sequences with rho > cap contribute 0."""

    kind: Literal["mis"] = "mis"
    cap: float = Field(2.0, gt=1)  # C: the largest sequence ratio that still counts


class OffPolicyGeoMask(Section):
    """Whole sequences whose geometric-mean ratio exp(mean log w) is outside [lo, hi] contribute 0."""

    kind: Literal["geo_mask"] = "geo_mask"
    lo: float = Field(0.999, gt=0, lt=1)  # lower end of the kept band
    hi: float = Field(1.001, gt=1)  # upper end of the kept band


class OffPolicyIcePop(Section):
    """IcePop: tokens with w outside [lo, hi] contribute 0, the others keep w."""

    kind: Literal["icepop"] = "icepop"
    lo: float = Field(0.5, gt=0, lt=1)  # lower end of the kept band
    hi: float = Field(5.0, gt=1)  # upper end of the kept band


class OffPolicyM2PO(Section):
    """M2PO: the tokens with the largest (log w)^2 contribute 0, as few as bring the mean of
    (log w)^2 over the kept tokens of a micro-batch to <= tau."""

    kind: Literal["m2po"] = "m2po"
    tau: float = Field(0.04, gt=0)  # tau_M2: the largest second moment of log w kept


OffPolicyConfig = Annotated[
    OffPolicyNone | OffPolicyCap | OffPolicyTIS | OffPolicyMIS | OffPolicyGeoMask | OffPolicyIcePop | OffPolicyM2PO,
    Field(discriminator="kind"),
]


KINDS = ("none", "cap", "tis", "mis", "geo_mask", "icepop", "m2po")
SEQUENCE_KINDS = ("mis", "geo_mask")


@dataclass(frozen=True)
class Correction:
    """What a correction did to one micro-batch (all tensors shaped like the token inputs)."""

    weight: torch.Tensor  # c_t: the weight that replaces w_t (0 at dropped and invalid tokens)
    masked: torch.Tensor  # bool: valid tokens whose weight was set to 0
    truncated: torch.Tensor  # bool: valid tokens whose weight was lowered but kept


def sequence_index(shape: torch.Size, seq_lens, device) -> tuple[torch.Tensor, int] | None:
    """(sequence number of every token, number of sequences) for token inputs of ``shape``.

    ``seq_lens`` given: the inputs are packed 1-D, sequence ``i`` being the next ``seq_lens[i]``
    tokens. Otherwise the rows of an input with two or more dimensions are the sequences; a 1-D
    input without ``seq_lens`` has no sequences (None)."""
    if seq_lens is not None:
        lens = _checked_lens(shape, seq_lens)
        counts = torch.tensor(lens, dtype=torch.long, device=device)
        return torch.repeat_interleave(torch.arange(len(lens), device=device), counts), len(lens)
    if len(shape) < 2:
        return None
    rows = torch.arange(shape[0], device=device).view(-1, *([1] * (len(shape) - 1)))
    return rows.expand(shape), shape[0]


def _checked_lens(shape: torch.Size, seq_lens) -> list[int]:
    lens = [int(n) for n in seq_lens]
    if len(shape) != 1:
        raise ValueError(f"seq_lens describes packed 1-D inputs, got inputs of shape {tuple(shape)}")
    if any(n < 0 for n in lens) or sum(lens) != shape[0]:
        raise ValueError(f"seq_lens must be lengths >= 0 that add up to the {shape[0]} tokens, got {lens}")
    return lens


def _per_sequence_sum(values: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    out = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    return out.index_add_(0, seq.reshape(-1), values.reshape(-1))


def _result(weight, valid, keep, truncated=None) -> Correction:
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    keep = keep & valid
    none = torch.zeros_like(valid)
    return Correction(
        weight=torch.where(keep, weight, zero),
        masked=valid & ~keep,
        truncated=none if truncated is None else truncated & keep,
    )


def no_correction(log_w: torch.Tensor, valid: torch.Tensor) -> Correction:
    """``c_t = w_t``: the plain decoupled objective (AReaL, Fu et al. 2025, arXiv:2505.24298)."""
    return _result(torch.exp(log_w), valid, valid)


def cap_mask(log_w: torch.Tensor, valid: torch.Tensor, cap: float) -> Correction:
    """``c_t = w_t * 1[w_t <= C]``: tokens whose behaviour weight passes ``C`` are dropped.

    Source: AReaL's decoupled PPO loss, ``behav_imp_weight_cap`` (Fu et al. 2025; AReaL's
    configs use C = 5)."""
    w = torch.exp(log_w)
    return _result(w, valid, w <= cap)


def tis_weights(log_w: torch.Tensor, valid: torch.Tensor, cap: float) -> Correction:
    """``c_t = min(w_t, C)``: token-level truncated importance sampling; no token is dropped.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (TIS); verl's rollout correction ``rollout_is: token`` with
    ``rollout_is_threshold`` C (docs/algo/rollout_corr_math.md, section 3.3.1)."""
    log_c = math.log(cap)
    return _result(torch.exp(torch.clamp(log_w, max=log_c)), valid, valid, truncated=log_w > log_c)


def mis_weights(log_w: torch.Tensor, valid: torch.Tensor, seq: torch.Tensor, n_seqs: int, cap: float) -> Correction:
    """Sequence-level masked importance sampling: ``c_t = rho_s * 1[rho_s <= C]`` for every token
    of sequence ``s``, with ``rho_s = prod_{t in s} w_t = exp(sum_{t in s} log w_t)`` (summed in
    log space; a sequence whose ratio passes ``C`` is dropped whole, not truncated).

    Source: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (Seq-MIS); verl's ``seq_mis`` preset, sequence-level IS weights
    with sequence rejection above the same threshold (docs/algo/rollout_corr.md)."""
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    log_rho = _per_sequence_sum(torch.where(valid, log_w, zero), seq, n_seqs)[seq]
    keep = log_rho <= math.log(cap)
    # exp of the kept ratios only: a dropped sequence's ratio may overflow
    return _result(torch.exp(torch.where(keep, log_rho, zero)), valid, keep)


def geo_mask(
    log_w: torch.Tensor, valid: torch.Tensor, seq: torch.Tensor, n_seqs: int, lo: float, hi: float
) -> Correction:
    """``c_t = w_t * 1[lo <= g_s <= hi]`` with the geometric-mean ratio of the token's sequence
    ``g_s = exp(mean_{t in s} log w_t)``: whole sequences outside the band are dropped; the kept
    ones keep their per-token weights (verl's geometric rejection keeps no weight, ``c_t = 1``).

    Source: verl's rollout correction ``rollout_rs: geometric`` (docs/algo/rollout_corr_math.md,
    section 3.3.3; Liu, Li et al. 2025), where typical bands are 1.0002 to 1.001 wide."""
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    total = _per_sequence_sum(torch.where(valid, log_w, zero), seq, n_seqs)
    count = _per_sequence_sum(valid.to(log_w.dtype), seq, n_seqs)
    mean = (total / count.clamp(min=1.0))[seq]
    keep = (mean >= math.log(lo)) & (mean <= math.log(hi))
    return _result(torch.exp(log_w), valid, keep)


def icepop_mask(log_w: torch.Tensor, valid: torch.Tensor, lo: float, hi: float) -> Correction:
    """``c_t = w_t * 1[lo <= w_t <= hi]``: two-sided token masking, tokens outside the band
    contribute 0.

    Source: IcePop, Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
    Trillion-Scale Thinking Model" (Ring-1T, arXiv:2510.18855): the mask M(k) = k for
    k in [alpha, beta], else 0, on the training/inference probability ratio k. Here k is
    ``w = pi_prox / pi_behav``."""
    w = torch.exp(log_w)
    return _result(w, valid, (w >= lo) & (w <= hi))


def m2po_mask(log_w: torch.Tensor, valid: torch.Tensor, tau: float) -> Correction:
    """M2PO's second-moment trust region: ``c_t = w_t``, except for the tokens it drops.

    Rule: with ``m_t = (log w_t)^2`` over the n valid tokens sorted from largest to smallest
    (ties: the earlier token first), drop the first k of them for the smallest k >= 0 such that
    the mean of the remaining ``n - k`` values is <= tau; if even the smallest value alone is
    above tau, all n are dropped. Dropping the largest value never raises the mean, so this k
    is the fewest tokens that bring the second moment within tau. It is computed over the
    tokens the loss sees at once (one micro-batch), as AReaL's implementation does.

    Source: Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
    Stale Data on LLMs?" (M2PO, arXiv:2510.01161), M2 = mean (log pi / pi_behav)^2 with
    threshold tau_M2; AReaL's ``m2_threshold`` (docs/algorithms/m2po.md). Here the ratio is
    ``w = pi_prox / pi_behav``, fixed for the whole step."""
    m2 = (log_w * log_w)[valid]
    drop = torch.zeros_like(m2, dtype=torch.bool)
    n = m2.numel()
    if n:
        values, order = torch.sort(m2, descending=True, stable=True)
        suffix = torch.flip(torch.cumsum(torch.flip(values, [0]), 0), [0])  # sum of values[k:]
        means = suffix / torch.arange(n, 0, -1, dtype=values.dtype, device=values.device)
        ok = torch.nonzero(means <= tau)
        k = int(ok[0, 0]) if ok.numel() else n
        drop[order[:k]] = True
    keep = valid.clone()
    keep[valid] = ~drop
    return _result(torch.exp(log_w), valid, keep)


def off_policy_correction(
    spec: OffPolicyConfig | None, log_w: torch.Tensor, valid: torch.Tensor, seq_lens=None
) -> Correction:
    """The weights of ``spec`` (a ``trainer.off_policy`` config; None: ``none``) for the tokens
    with log behaviour weights ``log_w`` (0 at invalid tokens) and validity ``valid``."""
    kind = "none" if spec is None else getattr(spec, "kind", None)
    if kind is None:
        raise TypeError(
            f"off_policy must be a trainer.off_policy config (it has a kind) or None, got {type(spec).__name__}"
        )
    if kind not in KINDS:
        raise ValueError(f"off_policy.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in SEQUENCE_KINDS:
        found = sequence_index(log_w.shape, seq_lens, log_w.device)
        if found is None:
            raise ValueError(
                f"off_policy kind {kind!r} works per sequence: pass [batch, T] inputs (a row per "
                "sequence) or seq_lens with packed 1-D inputs"
            )
        seq, n_seqs = found
        if kind == "mis":
            return mis_weights(log_w, valid, seq, n_seqs, spec.cap)
        return geo_mask(log_w, valid, seq, n_seqs, spec.lo, spec.hi)
    if seq_lens is not None:
        _checked_lens(log_w.shape, seq_lens)  # the same checks, whatever the kind
    if kind == "cap":
        return cap_mask(log_w, valid, spec.cap)
    if kind == "tis":
        return tis_weights(log_w, valid, spec.cap)
    if kind == "icepop":
        return icepop_mask(log_w, valid, spec.lo, spec.hi)
    if kind == "m2po":
        return m2po_mask(log_w, valid, spec.tau)
    return no_correction(log_w, valid)
