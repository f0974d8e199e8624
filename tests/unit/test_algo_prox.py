"""Log-linear pi_prox approximation against a per-token reference written from the formula."""

import math

import pytest
import torch

from areal_core.algo.prox import loglinear_prox_logp, prox_alpha


def reference(behav, current, versions, version):
    """Per token, in plain floats: v_prox = version, v_theta = version + 1."""
    out = []
    for b, c, v in zip(behav, current, versions):
        gap = version - v  # versions between the behaviour policy and pi_prox
        alpha = gap / (gap + 1)
        out.append(math.log(math.exp(b) ** (1 - alpha) * math.exp(c) ** alpha))  # geometric mean in prob space
    return out


def test_matches_reference_with_gaps():
    g = torch.Generator().manual_seed(0)
    n = 200
    version = 9
    versions = torch.randint(0, version + 1, (n,), generator=g)
    behav = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    current = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    got = loglinear_prox_logp(behav, current, versions, version)
    want = torch.tensor(reference(behav.tolist(), current.tolist(), versions.tolist(), version), dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_current_version_tokens_keep_behaviour_logprob():
    behav = torch.tensor([-1.0, -2.0, -0.5])
    current = torch.tensor([-3.0, -0.1, -0.7])
    got = loglinear_prox_logp(behav, current, torch.tensor([4, 4, 4]), 4)
    assert torch.equal(got, behav)


def test_alpha_by_gap_and_limits():
    versions = torch.tensor([7, 6, 5, 3, 0])
    torch.testing.assert_close(
        prox_alpha(versions, prox_version=7, theta_version=8),
        torch.tensor([0.0, 1 / 2, 2 / 3, 4 / 5, 7 / 8], dtype=torch.float64),
    )
    # AReaL's labelling (one lower): fresh and one-step-old tokens both keep the behaviour logprob
    torch.testing.assert_close(
        prox_alpha(versions, prox_version=6, theta_version=7),
        torch.tensor([0.0, 0.0, 1 / 2, 3 / 4, 6 / 7], dtype=torch.float64),
    )
    # v_theta <= v_behav: alpha 0, never a division by zero; alpha is clipped to [0, 1]
    assert prox_alpha(torch.tensor([5, 9]), prox_version=5, theta_version=5).tolist() == [0.0, 0.0]
    assert prox_alpha(torch.tensor([2]), prox_version=9, theta_version=4).tolist() == [1.0]


def test_no_gradient_into_prox():
    current = torch.tensor([-1.0, -2.0], requires_grad=True)
    out = loglinear_prox_logp(torch.tensor([-1.5, -1.0]), current, torch.tensor([0, 1]), 2)
    assert not out.requires_grad


def test_bad_input_is_named():
    b = torch.zeros(3)
    with pytest.raises(ValueError, match="newer than the policy"):
        loglinear_prox_logp(b, b, torch.tensor([0, 5, 1]), 4)
    with pytest.raises(ValueError, match="one shape"):
        loglinear_prox_logp(b, torch.zeros(2), torch.tensor([0, 1, 1]), 4)
    with pytest.raises(TypeError, match="integers"):
        loglinear_prox_logp(b, b, torch.tensor([0.0, 1.0, 1.0]), 4)
