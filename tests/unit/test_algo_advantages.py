"""Critic-free advantages against a NumPy reference."""

import numpy as np
import pytest
import torch

from areal_core.algo import compute_advantages
from areal_core.algo.advantages import expand_to_tokens


def np_normalise(r, eps):
    r = np.asarray(r, dtype=np.float64)
    if np.all(r == r[0]):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=0) + eps)


def test_batch_mode_matches_numpy():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=17)
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), mode="batch", eps=1e-6)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), np_normalise(rewards, 1e-6), rtol=1e-12)
    # list input, default eps: same numbers in the default float dtype
    got32 = compute_advantages(list(rewards))
    assert got32.dtype == torch.get_default_dtype()
    np.testing.assert_allclose(got32.numpy(), np_normalise(rewards, 1e-6), rtol=1e-5, atol=1e-6)


def test_group_mode_matches_numpy():
    rng = np.random.default_rng(1)
    group_ids = ["a", ("p", 2), 7, "a", 7, "a", ("p", 2), "solo", 7, "a"]
    rewards = rng.integers(0, 2, size=len(group_ids)).astype(np.float64) + rng.normal(size=len(group_ids))
    expected = np.empty_like(rewards)
    for gid in set(group_ids):
        idx = [i for i, g in enumerate(group_ids) if g == gid]
        expected[idx] = np_normalise(rewards[idx], 1e-6)
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), group_ids, mode="group")
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    assert got[7].item() == 0.0  # a singleton group has no signal


def test_group_mode_binary_rewards():
    # GRPO-style 0/1 correctness: group "x" has 1 of 4 right, group "y" all right
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    got = compute_advantages(rewards, ["x"] * 4 + ["y"] * 2, mode="group", eps=0.0)
    np.testing.assert_allclose(
        got.numpy(), [np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), 0, 0], rtol=1e-6
    )


@pytest.mark.parametrize("value", [0.1, 1.0, -3.7])
def test_constant_rewards_give_exact_zeros(value):
    r = torch.full((5,), value, dtype=torch.float64)
    assert torch.equal(compute_advantages(r), torch.zeros(5, dtype=torch.float64))
    assert torch.equal(compute_advantages(r, ["g"] * 5, mode="group"), torch.zeros(5, dtype=torch.float64))


def test_none_mode_and_edge_cases():
    r = torch.tensor([1.0, 2.0, 3.0])
    out = compute_advantages(r, mode="none")
    assert torch.equal(out, r)
    out[0] = 99.0
    assert r[0].item() == 1.0  # a copy, not a view
    assert compute_advantages(torch.tensor([1, 0, 1])).is_floating_point()
    assert compute_advantages([]).numel() == 0


def test_expand_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert torch.equal(expand_to_tokens(adv, mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="expected advantages"):
        expand_to_tokens(adv, mask[:1])


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage mode 'grpo'"):
        compute_advantages([1.0, 2.0], mode="grpo")
    with pytest.raises(ValueError, match="group_ids has 1 entries but there are 2 rewards"):
        compute_advantages([1.0, 2.0], ["a"], mode="group")
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages([1.0, 2.0], mode="group")
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"non-finite values at indices \[1\]"):
        compute_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="eps"):
        compute_advantages([1.0], eps=-1.0)
