"""Per-sequence causal attention over a packed stream, against an explicit float64 softmax per sequence."""

import pytest
import torch

from areal_core.trainer.packed_attention import packed_causal_attention, per_sequence_sdpa


def _reference(q, k, v, lens, scale):
    """softmax(q k^T * scale + causal mask) v, one sequence at a time, key/value heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    outs, a = [], 0
    for n in lens:
        qs, ks, vs = (t[a : a + n].double().transpose(0, 1) for t in (q, k, v))  # [h, n, d]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        a += n
    return torch.cat(outs)


def _inputs(lens, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return [torch.randn(T, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("impl", ["fused_cpu", "per_sequence_sdpa"])
@pytest.mark.parametrize("lens", [[1], [5, 1, 17, 3], [40, 40, 2], [9] * 6])
def test_values_and_gradients_match_reference(impl, lens):
    q, k, v = _inputs(lens)
    scale = 0.3
    if impl == "fused_cpu":
        out = packed_causal_attention(q, k, v, lens, scale)
    else:
        out = per_sequence_sdpa(q, k, v, lens, scale)
    ref = _reference(q, k, v, lens, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g.double())
    for name, a, b in zip("qkv", ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def test_sequences_do_not_see_each_other():
    lens = [6, 4]
    q, k, v = _inputs(lens)
    out = packed_causal_attention(q, k, v, lens, 0.5)
    with torch.no_grad():
        k2, v2 = k.clone(), v.clone()
        k2[:6] += 3.0  # change the first sequence's keys and values only
        v2[:6] -= 2.0
    out2 = packed_causal_attention(q, k2, v2, lens, 0.5)
    torch.testing.assert_close(out2[6:], out[6:])
    assert not torch.allclose(out2[:6], out[:6])


def test_bad_input_is_named():
    q, k, v = _inputs([3, 4])
    with pytest.raises(ValueError, match="do not tile"):
        packed_causal_attention(q, k, v, [3, 3], 1.0)
    with pytest.raises(ValueError, match="do not tile"):
        packed_causal_attention(q, k, v, [7, 0], 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        packed_causal_attention(q, k[:, :1].expand(7, 3, 8), v[:, :1].expand(7, 3, 8), [3, 4], 1.0)


@pytest.mark.parametrize("lens", [[5, 1, 17, 3], [40, 40, 2]])
def test_bfloat16_gradients_come_back_in_bfloat16_near_the_exact_ones(lens):
    """A bfloat16 stream's backward runs in float32 on its inputs cast up: its gradients are bfloat16,
    within bfloat16's rounding of the float64 gradients of the same (bfloat16-rounded) inputs."""
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in _inputs(lens, hq=6, hkv=2, d=16))
    out = packed_causal_attention(q, k, v, lens, 0.25)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ours = torch.autograd.grad(out, (q, k, v), g)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    theirs = torch.autograd.grad(_reference(*exact, lens, 0.25), exact, g.double())
    for name, a, b in zip("qkv", ours, theirs):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.double(), b, atol=2e-2, rtol=2e-2, msg=f"grad of {name}")


def _reference_last_queries(q, k, v, lens, key_lens, scale):
    """Each sequence's ``key_lens[i]`` positions in full (their queries too, taken from a full-length
    query stream), with only its last ``lens[i]`` outputs kept: fewer queries than keys is the tail of
    an ordinary causal attention."""
    rep = q.shape[1] // k.shape[1]
    outs, a, c = [], 0, 0
    for n, m in zip(lens, key_lens):
        qs = q[a : a + n].double().transpose(0, 1)  # [h, n, d]: positions m - n .. m - 1
        ks, vs = (t[c : c + m].double().transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        a, c = a + n, c + m
    return torch.cat(outs)


@pytest.mark.parametrize("impl", ["fused_cpu", "per_sequence_sdpa"])
@pytest.mark.parametrize(("lens", "key_lens"), [([1], [9]), ([5, 7, 1, 3], [12, 7, 4, 30]), ([4, 40], [44, 41])])
def test_fewer_queries_than_keys_see_every_key_up_to_their_own_position(impl, lens, key_lens):
    """An answer sharing its prompt brings only its own queries: each is the last of its sequence's keys,
    so query i of n sees keys 0..m - n + i (not 0..i, PyTorch's causal mask for n < m)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens), 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(key_lens), 2, 8, generator=g, requires_grad=True) for _ in range(2))
    fn = packed_causal_attention if impl == "fused_cpu" else per_sequence_sdpa
    out = fn(q, k, v, lens, 0.3, key_lens)
    ref = _reference_last_queries(q, k, v, lens, key_lens, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad.double())
    for name, a, b in zip("qkv", ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def test_fewer_queries_than_keys_in_bfloat16_stay_near_the_exact_values():
    lens, key_lens = [5, 2, 30], [40, 9, 30]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lens), 6, 16, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(sum(key_lens), 2, 16, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    out = packed_causal_attention(q, k, v, lens, 0.25, key_lens)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _reference_last_queries(*exact, lens, key_lens, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, exact, grad.double())
    for name, a, b in zip("qkv", ours, theirs):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.double(), b, atol=2e-2, rtol=2e-2, msg=f"grad of {name}")


def test_key_counts_that_do_not_fit_are_named():
    q, k, v = _inputs([3, 4])
    with pytest.raises(ValueError, match="key counts"):
        packed_causal_attention(q, k, v, [3, 4], 1.0, [4, 3])  # fewer keys than queries
    with pytest.raises(ValueError, match="key counts"):
        packed_causal_attention(q, k, v, [3, 4], 1.0, [3, 5])  # not the 7 keys there are


def test_bottom_right_masks_are_views_of_a_few_cached_causal_masks():
    """Each (queries, keys) mask equals the mask built directly, and however many lengths come, the
    cache holds one causal mask per power-of-two size and dtype, not one per pair of lengths."""
    from areal_core.trainer.packed_attention import _causal_mask, _lower_right_mask

    _causal_mask.cache_clear()
    for n_k in range(1, 70):
        for n_q in range(1, n_k + 1):
            direct = torch.zeros(n_q, n_k).masked_fill_(
                torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1), float("-inf")
            )
            assert torch.equal(_lower_right_mask(n_q, n_k, torch.float32)[0, 0], direct), (n_q, n_k)
    assert _causal_mask.cache_info().misses == 8  # built once per size 1, 2, 4, ..., 128 (not per key count)
