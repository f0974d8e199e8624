"""The behaviour logprob under top-k / top-p: the logprob of the distribution the token was
drawn from (renormalised over the kept tokens), checked against a reference written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.rollout.backends.embedded.sampling import BatchSampler, RowSampling


def _reference_logprob(row: list[float], token: int, temperature: float, top_p: float, top_k: int) -> float:
    """By hand, in float64: scale, keep the top_k most likely, then the most likely tokens
    until their (renormalised) mass reaches top_p, and renormalise over what is kept."""
    weights = [math.exp(x / temperature) for x in row]
    order = sorted(range(len(row)), key=lambda i: -weights[i])
    if top_k > 0:
        order = order[:top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    assert token in kept, f"token {token} was drawn but lies outside the kept set {kept}"
    return math.log(weights[token] / sum(weights[i] for i in kept))


def test_top_k_1_is_a_point_mass():
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(3)) * 3
    rows = [RowSampling(1.0, 1.0, 1, None)] * 64
    tokens, logprobs = BatchSampler(rows, 40, torch.Generator().manual_seed(0)).sample(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.zeros(64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 0.9, 0), (0.7, 0.6, 0), (1.3, 0.8, 12), (1.0, 1.0, 5)])
def test_filtered_logprob_matches_the_reference(temperature, top_p, top_k):
    """Every fourth row is greedy: argmax, with the unfiltered ``log_softmax(logits)`` as logprob."""
    n, vocab = 200, 50
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * 2
    rows = [RowSampling(0.0 if i % 4 == 0 else temperature, top_p, top_k, None) for i in range(n)]
    tokens, logprobs = BatchSampler(rows, vocab, torch.Generator().manual_seed(5)).sample(logits)
    want = []
    for i, (row, t) in enumerate(zip(logits.double().tolist(), tokens.tolist())):
        if i % 4 == 0:
            assert t == max(range(vocab), key=row.__getitem__)
            want.append(row[t] - math.log(sum(math.exp(x) for x in row)))
        else:
            want.append(_reference_logprob(row, t, temperature, top_p, top_k))
    torch.testing.assert_close(logprobs.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
