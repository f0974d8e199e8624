"""Decoupled / naive PPO losses against a float64 loop reference and hand-derived gradients."""

import math

import numpy as np
import pytest
import torch

from areal_core.algo import decoupled_ppo_loss, naive_ppo_loss
from areal_core.algo.off_policy import OffPolicyCap

F64 = torch.float64


def capped(cap):
    """The ``cap`` correction at ``cap`` (None: no correction)."""
    return None if cap is None else OffPolicyCap(cap=cap)


def reference(logp, prox, behav, adv, mask, eps, cap=None, n_tokens=None):
    """Branch-by-branch loop: (loss, d loss / d logp, n clipped, weights w over valid tokens)."""
    lp, px, bh, a = (np.asarray(t.detach(), dtype=np.float64).ravel() for t in (logp, prox, behav, adv))
    m = np.asarray(mask, dtype=np.float64).ravel()
    grad = np.zeros_like(lp)
    total, n_clipped, weights, us, kls = 0.0, 0, [], [], []
    for k in range(lp.size):
        if m[k] == 0:
            continue
        u = math.exp(lp[k] - px[k])
        w = math.exp(px[k] - bh[k])
        weights.append(w)
        us.append(u)
        kls.append(px[k] - lp[k])
        if u > 1 + eps:
            u_clip = 1 + eps
        elif u < 1 - eps:
            u_clip = 1 - eps
        else:
            u_clip = u
        unclipped_term, clipped_term = u * a[k], u_clip * a[k]
        clip_active = clipped_term < unclipped_term
        n_clipped += clip_active
        if cap is not None and w > cap:
            continue
        if clip_active:
            total += -w * clipped_term
        else:
            total += -w * unclipped_term
            grad[k] = -w * u * a[k]
    denom = m.sum() if n_tokens is None else n_tokens
    if denom == 0:
        return 0.0, np.zeros_like(lp), n_clipped, weights, us, kls
    return total / denom, grad / denom, n_clipped, weights, us, kls


def ragged_mask(shape, gen):
    if len(shape) == 1:
        return torch.rand(shape, generator=gen) < 0.7
    rows, seq = shape[0], int(np.prod(shape[1:]))
    lengths = torch.randint(0, seq + 1, (rows,), generator=gen)
    lengths[0] = 0  # one empty row
    lengths[-1] = seq  # one full row
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return mask.reshape(shape)


def make_inputs(shape, seed, spread=0.3):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen, dtype=F64) * 3
    prox = logp + spread * torch.randn(shape, generator=gen, dtype=F64)
    behav = prox + spread * torch.randn(shape, generator=gen, dtype=F64)
    adv = torch.randn(shape, generator=gen, dtype=F64)
    return logp, prox, behav, adv, ragged_mask(shape, gen)


SHAPES = [(7,), (4, 9), (3, 2, 5), (1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cap", [None, 1.1])
@pytest.mark.parametrize("float_mask", [False, True])
def test_decoupled_matches_reference(shape, cap, float_mask):
    logp, prox, behav, adv, mask = make_inputs(shape, seed=sum(shape) + (cap is None))
    lp = logp.clone().requires_grad_(True)
    m = mask.to(F64) if float_mask else mask
    loss, stats = decoupled_ppo_loss(lp, prox, behav, adv, m, eps_clip=0.2, off_policy=capped(cap))
    loss.backward()
    ref_loss, ref_grad, n_clip, ws, us, kls = reference(logp, prox, behav, adv, mask, 0.2, cap)
    n = int(mask.sum())
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(lp.grad.numpy().ravel(), ref_grad, rtol=1e-12, atol=1e-12)
    if n:
        assert stats["clip_fraction"] == pytest.approx(n_clip / n)
        assert stats["behav_weight_mean"] == pytest.approx(np.mean(ws))
        assert stats["behav_weight_max"] == pytest.approx(np.max(ws))
        assert stats["importance_weight_mean"] == pytest.approx(np.mean(us))
        assert stats["approx_kl"] == pytest.approx(np.mean(kls))
        n_capped = sum(w > cap for w in ws) if cap is not None else 0
        assert stats["offpolicy_masked_fraction"] == pytest.approx(n_capped / n)
        assert stats["offpolicy_truncated_fraction"] == 0.0
    assert all(isinstance(v, float) for v in stats.values())


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_naive_matches_reference(shape):
    logp, _, behav, adv, mask = make_inputs(shape, seed=100 + sum(shape), spread=0.4)
    lp = logp.clone().requires_grad_(True)
    loss, stats = naive_ppo_loss(lp, behav, adv, mask, eps_clip=0.1)
    loss.backward()
    ref_loss, ref_grad, n_clip, _, us, kls = reference(logp, behav, behav, adv, mask, 0.1)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(lp.grad.numpy().ravel(), ref_grad, rtol=1e-12, atol=1e-12)
    n = int(mask.sum())
    assert stats["clip_fraction"] == pytest.approx(n_clip / n)
    assert stats["approx_kl"] == pytest.approx(np.mean(kls))
    assert stats["importance_weight_mean"] == pytest.approx(np.mean(us))
    assert stats["behav_weight_mean"] == 1.0 and stats["behav_weight_max"] == 1.0
    assert stats["offpolicy_masked_fraction"] == 0.0 and stats["offpolicy_truncated_fraction"] == 0.0
    assert stats["offpolicy_ess"] == 1.0 and stats["offpolicy_weight_max"] == 1.0


def test_reference_exercises_both_branches_and_weights():
    logp, prox, behav, adv, mask = make_inputs((4, 9), seed=13)
    _, _, n_clip, ws, _, _ = reference(logp, prox, behav, adv, mask, 0.2)
    assert 0 < n_clip < int(mask.sum())
    assert min(ws) < 0.9 and max(ws) > 1.1  # w really differs from 1


@pytest.mark.parametrize("cap", [None, 1.2])
def test_gradcheck_float64(cap):
    logp, prox, behav, adv, mask = make_inputs((3, 6), seed=7)
    u = torch.exp(logp - prox)
    assert ((u - 1.2).abs().min() > 1e-4) and ((u - 0.8).abs().min() > 1e-4)
    lp = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: decoupled_ppo_loss(x, prox, behav, adv, mask, off_policy=capped(cap))[0], (lp,)
    )
    assert torch.autograd.gradcheck(lambda x: naive_ppo_loss(x, behav, adv, mask)[0], (lp,))


def _single_token(d, a, eps, w=1.0):
    """One token with log-ratio d, advantage a, behaviour weight w; returns (loss, grad, stats)."""
    prox = torch.zeros(1, dtype=F64)
    behav = prox - math.log(w)
    lp = torch.tensor([d], dtype=F64, requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        lp, prox, behav, torch.tensor([a], dtype=F64), torch.ones(1, dtype=torch.bool), eps_clip=eps
    )
    loss.backward()
    return loss.item(), lp.grad.item(), stats


@pytest.mark.parametrize("a", [1.5, -0.7])
@pytest.mark.parametrize("side", ["upper", "lower"])
def test_clip_boundaries(a, side):
    d = 0.15 if side == "upper" else -0.25
    u = torch.exp(torch.tensor(d, dtype=F64)).item()
    w = torch.exp(torch.tensor(math.log(1.3), dtype=F64)).item()  # w as the loss computes it
    at_boundary = (u - 1.0) if side == "upper" else (1.0 - u)  # 1 +/- eps == u exactly
    assert (1.0 + at_boundary == u) if side == "upper" else (1.0 - at_boundary == u)
    # clipping bites for A > 0 above the range and for A < 0 below it
    clip_side = (a > 0) == (side == "upper")
    delta = 1e-9
    cases = {
        "exact": (at_boundary, False),  # tie: unclipped branch, gradient flows
        "inside": (at_boundary + delta, False),  # u strictly inside the range
        "outside": (at_boundary - delta, clip_side),  # u just outside the range
    }
    for name, (eps, clipped) in cases.items():
        loss, grad, stats = _single_token(d, a, eps, w=1.3)
        bound = 1 + eps if side == "upper" else 1 - eps
        if clipped:
            assert grad == 0.0, name
            assert loss == pytest.approx(-w * bound * a, rel=1e-12), name
            assert stats["clip_fraction"] == 1.0, name
        else:
            assert grad == pytest.approx(-w * u * a, rel=1e-12), name
            assert loss == pytest.approx(-w * u * a, rel=1e-12), name
            assert stats["clip_fraction"] == 0.0, name


def test_zero_advantage_is_never_clipped():
    loss, grad, stats = _single_token(0.5, 0.0, 0.2)
    assert loss == 0.0 and grad == 0.0 and stats["clip_fraction"] == 0.0


def test_cap_masks_numerator_but_not_denominator():
    prox = torch.zeros(4, dtype=F64)
    w = torch.tensor([0.5, 1.0, 3.0, 5.0], dtype=F64)
    behav = prox - torch.log(w)
    adv = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=F64)
    lp = torch.zeros(4, dtype=F64, requires_grad=True)  # u = 1 everywhere: unclipped
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(lp, prox, behav, adv, mask, off_policy=OffPolicyCap(cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 1.0 * -2.0) / 4)
    np.testing.assert_allclose(lp.grad.numpy(), [-0.5 / 4, 2.0 / 4, 0.0, 0.0], rtol=1e-12)
    assert stats["offpolicy_masked_fraction"] == 0.5
    assert stats["behav_weight_max"] == pytest.approx(5.0)
    assert stats["offpolicy_weight_max"] == pytest.approx(1.0)  # the largest weight kept
    assert stats["behav_weight_mean"] == pytest.approx(2.375)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_decoupled_equals_naive_when_prox_is_behav(shape):
    logp, _, behav, adv, mask = make_inputs(shape, seed=3 * sum(shape))
    results = []
    for fn in ("decoupled", "naive"):
        lp = logp.clone().requires_grad_(True)
        if fn == "decoupled":
            loss, stats = decoupled_ppo_loss(lp, behav, behav, adv, mask, off_policy=OffPolicyCap(cap=1.01))
        else:
            loss, stats = naive_ppo_loss(lp, behav, adv, mask)
        loss.backward()
        results.append((loss.item(), lp.grad.clone(), stats))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


@pytest.mark.parametrize("which", ["decoupled", "naive"])
def test_n_tokens_split_equals_whole_batch(which):
    logp, prox, behav, adv, mask = make_inputs((6, 10), seed=21)
    total = int(mask.sum())

    def run(lp, sl, n_tokens):
        if which == "decoupled":
            return decoupled_ppo_loss(
                lp[sl], prox[sl], behav[sl], adv[sl], mask[sl], off_policy=OffPolicyCap(cap=1.5), n_tokens=n_tokens
            )[0]
        return naive_ppo_loss(lp[sl], behav[sl], adv[sl], mask[sl], n_tokens=n_tokens)[0]

    lp_whole = logp.clone().requires_grad_(True)
    whole = run(lp_whole, slice(None), None)
    whole.backward()
    lp_split = logp.clone().requires_grad_(True)
    pieces = [run(lp_split, slice(a, b), total) for a, b in [(0, 2), (2, 3), (3, 6)]]
    split = sum(pieces)
    split.backward()
    assert split.item() == pytest.approx(whole.item(), abs=1e-12)
    assert torch.allclose(lp_split.grad, lp_whole.grad, rtol=0, atol=1e-6)
    # explicit n_tokens equal to the mask count is the default normalisation
    assert run(logp, slice(None), torch.tensor(total)).item() == pytest.approx(whole.item(), abs=1e-15)


def test_empty_mask_and_zero_n_tokens_give_zero_loss_with_grad():
    logp, prox, behav, adv, _ = make_inputs((2, 3), seed=5)
    lp = logp.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(lp, prox, behav, adv, torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert set(stats.values()) == {0.0}
    lp2 = logp.clone().requires_grad_(True)
    loss2, _ = naive_ppo_loss(lp2, behav, adv, torch.ones(2, 3), n_tokens=0)
    loss2.backward()
    assert loss2.item() == 0.0 and torch.equal(lp2.grad, torch.zeros_like(lp2))


def test_padding_garbage_does_not_leak():
    logp, prox, behav, adv, mask = make_inputs((3, 5), seed=9)
    ref_loss, ref_grad, *_ = reference(logp, prox, behav, adv, mask, 0.2)
    pad = ~mask
    logp[pad] = float("inf")
    prox[pad] = float("-inf")
    behav[pad] = float("nan")
    adv[pad] = float("nan")
    lp = logp.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(lp, prox, behav, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy().ravel(), ref_grad, rtol=1e-12, atol=1e-12)
    assert all(math.isfinite(v) for v in stats.values())


def test_no_gradient_to_prox_behav_or_advantages():
    logp, prox, behav, adv, mask = make_inputs((2, 4), seed=11)
    leaves = [t.clone().requires_grad_(True) for t in (logp, prox, behav, adv)]
    loss, _ = decoupled_ppo_loss(*leaves, mask)
    loss.backward()
    assert leaves[0].grad is not None
    assert all(t.grad is None for t in leaves[1:])


def test_input_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="behav_logp has shape"):
        decoupled_ppo_loss(x, x, torch.zeros(3, 2), x, x)
    with pytest.raises(ValueError, match="mask must be boolean or contain only 0 and 1"):
        naive_ppo_loss(x, x, x, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="eps_clip"):
        naive_ppo_loss(x, x, x, x, eps_clip=-0.1)
    with pytest.raises(ValueError, match="n_tokens"):
        naive_ppo_loss(x, x, x, x, n_tokens=-1)
    with pytest.raises(TypeError, match=r"off_policy must be a trainer\.off_policy config"):
        decoupled_ppo_loss(x, x, x, x, x, 0.2, 5.0)  # a bare number where the correction goes
    with pytest.raises(TypeError, match="floating-point"):
        naive_ppo_loss(torch.zeros(2, dtype=torch.long), x, x, x)
