"""The engine's lean forward (fused weights, K|V cache, rope table) and its sampler, against
plain Hugging Face forward passes and the exact softmax probabilities."""

from __future__ import annotations

import copy

import pytest
import torch

from areal_core.rollout.backends.embedded import onednn
from areal_core.rollout.backends.embedded.kv_forward import (
    FusedLayer,
    KVForward,
    PackedLayer,
    UnsupportedModelError,
    apply_weights,
)
from areal_core.rollout.backends.embedded.sampling import BatchSampler, RowSampling, stream_key
from tests.unit.test_engine import tiny_model


def hf_next_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """Logits after the last token of each sequence, one plain HF forward each."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, -1].float() for s in seqs])


def run_kv(kv: KVForward, prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """Prefill ``prompts`` into rows 0..n-1, then decode the continuations token by token
    (all the same length); returns the logits after the last fed token."""
    kv.ensure(len(prompts), max(map(len, prompts)) + len(continuations[0]) + 1)
    logits = kv.prefill(list(range(len(prompts))), prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    for step in range(len(continuations[0])):
        tokens = torch.tensor([c[step] for c in continuations])
        logits = kv.decode(tokens, lengths, int(lengths.max()) + 1)
        lengths += 1
    return logits


PROMPTS = [[5, 6, 7], [9], [11, 12, 13, 14, 15, 16], [20, 21]]
CONT = [[30, 31, 32, 33], [34, 35, 36, 37], [38, 39, 40, 41], [42, 43, 44, 45]]


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("qwen2", {}),
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"num_key_value_heads": 4}),
        ("mistral", {}),
    ],
)
def test_prefill_and_decode_match_hf(arch, extra):
    model = tiny_model(arch, seed=11, **extra)
    if extra.get("attention_bias"):
        with torch.no_grad():  # the default init leaves biases at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
    kv = KVForward(model, max_slots=4, init_slots=1, init_capacity=4)  # the cache grows on the way
    got = run_kv(kv, PROMPTS, CONT)
    want = hf_next_logits(model, [p + c for p, c in zip(PROMPTS, CONT)])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


ATTENTION_WAYS = ["fused", "three calls, keys first", "three calls, queries first"]


def _attention_way(kv: KVForward, way: str) -> KVForward:
    kv.fused_attention = way == "fused"
    kv.query_first_scores = way.endswith("queries first")
    return kv


@pytest.mark.parametrize("way", ATTENTION_WAYS)
def test_each_way_of_decode_attention_matches_hf(way):
    """Decode attention as one flash-attention call and as three (a score product, a softmax and a
    value product; the score product either way round): each matches plain HF forward passes in
    float32, grouped kv heads included."""
    model = tiny_model("llama", seed=11, num_key_value_heads=4)
    kv = _attention_way(KVForward(model, max_slots=4, init_slots=1, init_capacity=4), way)
    got = run_kv(kv, PROMPTS, CONT)
    want = hf_next_logits(model, [p + c for p, c in zip(PROMPTS, CONT)])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_bf16_decode_scores_queries_first_where_onednn_runs_them_and_as_close_to_float32_as_keys_first():
    """In bfloat16 where oneDNN runs the products the score product is q . keys^T over a copy of the
    keys (not in batch-invariant mode): against the float32 forward no further off than keys . q^T
    over the cache's view."""
    model = tiny_model("llama", seed=11, num_key_value_heads=4)
    want = hf_next_logits(model, [p + c for p, c in zip(PROMPTS, CONT)])
    model = model.to(torch.bfloat16)
    assert KVForward(model, max_slots=4).query_first_scores is BF16_PACKED
    assert not KVForward(model, max_slots=4, batch_invariant=True).query_first_scores
    assert not KVForward(tiny_model("llama", seed=11), max_slots=4).query_first_scores  # float32
    err = {}
    for way in ATTENTION_WAYS[1:]:
        kv = _attention_way(KVForward(model, max_slots=4, init_slots=1, init_capacity=4), way)
        err[way] = (run_kv(kv, PROMPTS, CONT) - want).abs().max()
    assert err["three calls, keys first"] > 0  # bfloat16 arithmetic
    assert err["three calls, queries first"] <= 1.5 * err["three calls, keys first"], err


def test_decode_attention_is_fused_except_in_bf16_on_a_cpu():
    from areal_core.rollout.backends.embedded.kv_forward import fused_decode_attention

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert fused_decode_attention(torch.float32, cpu)
    assert fused_decode_attention(torch.bfloat16, gpu)
    assert not fused_decode_attention(torch.bfloat16, cpu)
    assert KVForward(tiny_model("qwen2", seed=11), max_slots=4).fused_attention  # float32 here: fused


def _in_place_calls(kv: KVForward) -> list[bool]:
    """Record, per decode step, whether attention read the whole capacity in place (its keys and
    values then one contiguous block each)."""
    seen, decide, attend = [], kv._in_place, kv._attention

    def spy_decide(L):
        seen.append(decide(L))
        return seen[-1]

    def spy_attend(mask, q, keys, values):
        if seen and seen[-1]:
            assert keys.shape[1] == kv.capacity and keys.is_contiguous() and values.is_contiguous()
        return attend(mask, q, keys, values)

    kv._in_place, kv._attention = spy_decide, spy_attend
    return seen


def _decode_then_move(kv: KVForward) -> torch.Tensor:
    """:func:`run_kv`, then row 3 moved onto row 1 (which held a longer sequence: its stale positions
    past row 3's length stay in the cache) and three rows decoded twice more; the last logits."""
    run_kv(kv, PROMPTS, CONT)
    lengths = [len(p) + len(c) for p, c in zip(PROMPTS, CONT)]
    kv.move_rows([1], [3], lengths[3])
    lengths = torch.tensor([lengths[0], lengths[3], lengths[2]])
    for token in (46, 47):
        logits = kv.decode(torch.tensor([token] * 3), lengths, int(lengths.max()) + 1)
        lengths += 1
    return logits


def _moved_reference(model) -> torch.Tensor:
    seqs = [p + c for p, c in zip(PROMPTS, CONT)]
    return hf_next_logits(model, [s + [46, 47] for s in (seqs[0], seqs[3], seqs[2])])


def test_decode_attention_over_the_whole_capacity_in_place_matches_hf():
    """Three-call decode attention reading every cached position up to the capacity in place (those no
    row holds masked, a moved row's stale ones among them) gives plain HF's logits, in float32 where
    the way is forced; it runs where the capacity is at most IN_PLACE_WIDENING times the positions."""
    from areal_core.rollout.backends.embedded.kv_forward import IN_PLACE_WIDENING

    model = tiny_model("llama", seed=11, num_key_value_heads=4)
    kv = _attention_way(KVForward(model, max_slots=4, init_slots=1, init_capacity=4), "three calls, keys first")
    assert not kv.attend_in_place  # float32: MKL's products read the view in place anyway
    kv.attend_in_place = True
    in_place = _in_place_calls(kv)
    torch.testing.assert_close(_decode_then_move(kv), _moved_reference(model), atol=2e-4, rtol=0)
    # the cache holds 11 positions while the continuations run (a prompt of 6, 4 tokens and the next):
    # the steps needing 7 and 8 (11 > 1.25 * 8) read those, the next two and the first after the move
    # all 11; the last needs 12, the cache doubles to 22, and it reads the 12
    assert kv.capacity == 22 and IN_PLACE_WIDENING == 1.25
    assert in_place == [False, False, True, True, True, False]


@pytest.mark.parametrize(
    "growth,capacities,in_place",
    [
        # by 1.25: every step after the first growth reads the whole capacity
        (1.25, [10, 13, 17, 22, 28, 35], [False] + [True] * 23),
        # doubling: after a growth, not until the positions reach 0.8 of the capacity
        (2.0, [10, 20, 40], [False, True, True, True] + [False] * 5 + [True] * 5 + [False] * 10),
    ],
)
def test_capacity_grows_by_the_in_place_widening_so_attention_keeps_reading_it_in_place(growth, capacities, in_place):
    """Where decode attention may read the whole capacity in place, a capacity that the longest row
    outgrows grows by IN_PLACE_WIDENING (elsewhere it doubles), so the widening never exceeds it after
    a growth; across the growths the logits are plain HF's (float32, the way forced)."""
    from areal_core.rollout.backends.embedded.kv_forward import IN_PLACE_WIDENING

    model = tiny_model("llama", seed=11, num_key_value_heads=4)
    assert KVForward(model, max_slots=4).capacity_growth == 2.0  # float32 reads no capacity in place
    assert IN_PLACE_WIDENING == 1.25
    kv = _attention_way(KVForward(model, max_slots=4, init_slots=4, init_capacity=10), "three calls, keys first")
    kv.attend_in_place, kv.capacity_growth = True, growth
    seen = _in_place_calls(kv)
    kv.ensure(4, 7)
    kv.prefill(list(range(4)), PROMPTS)
    cont = [[4 + (5 * i + 3 * k) % 60 for k in range(24)] for i in range(4)]
    lengths, grown = torch.tensor([len(p) for p in PROMPTS]), [kv.capacity]
    for step in range(24):  # the longest row (a prompt of 6) needs 7 to 30 positions
        logits = kv.decode(torch.tensor([c[step] for c in cont]), lengths, int(lengths.max()) + 1)
        lengths += 1
        grown += [kv.capacity] if kv.capacity != grown[-1] else []
    torch.testing.assert_close(logits, hf_next_logits(model, [p + c for p, c in zip(PROMPTS, cont)]), atol=2e-4, rtol=0)
    assert grown == capacities
    assert seen == in_place


@pytest.mark.skipif(
    not onednn.packable(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's torch has no oneDNN bfloat16 products (no AVX-512 or bf16 units)",
)
def test_bf16_decode_attention_reads_the_whole_capacity_in_place_and_is_as_close_to_float32():
    """Where oneDNN runs the bfloat16 products (which copy a view of the cache before they multiply),
    decode attention reads the whole capacity in place, outside batch-invariant mode; against the
    float32 forward no further off than over the positions needed."""
    model = tiny_model("llama", seed=11, num_key_value_heads=4)
    want = _moved_reference(model)
    model = model.to(torch.bfloat16)
    assert KVForward(model, max_slots=4).attend_in_place
    err = {}
    for in_place in (True, False):
        kv = KVForward(model, max_slots=4, init_slots=1, init_capacity=4)
        kv.attend_in_place = in_place
        seen = _in_place_calls(kv)
        err[in_place] = (_decode_then_move(kv) - want).abs().max()
        assert any(seen) is in_place
    assert 0 < err[True] <= 1.5 * err[False], err
    invariant = KVForward(model, max_slots=4, init_slots=1, init_capacity=4, batch_invariant=True)
    seen = _in_place_calls(invariant)
    _decode_then_move(invariant)
    assert seen and not any(seen)


def test_weights_changed_rebuilds_the_fused_weights_and_keeps_the_cache():
    old, new = tiny_model("qwen2", seed=12), tiny_model("qwen2", seed=13)
    model = copy.deepcopy(old)
    kv = KVForward(model, max_slots=4)
    one = [c[:1] for c in CONT]
    want_new = hf_next_logits(new, [p + c for p, c in zip(PROMPTS, one)])
    apply_weights(model, {n: p.detach().clone() for n, p in new.named_parameters()})
    # without the call the fused q/k/v and gate/up projections still hold the old weights
    assert (run_kv(kv, PROMPTS, one) - want_new).abs().max() > 1e-2
    kv.weights_changed()
    torch.testing.assert_close(run_kv(kv, PROMPTS, one), want_new, atol=2e-4, rtol=0)
    # a cache filled under the old weights survives the call (what a keep_kv update relies on)
    old_kv = KVForward(copy.deepcopy(old), max_slots=4)
    old_kv.ensure(4, 16)
    old_kv.prefill(list(range(4)), PROMPTS)
    kv.release()
    kv.ensure(4, 16)
    for t, c in zip(kv.kv, old_kv.kv):
        t.copy_(c)
    kv.mask.copy_(old_kv.mask)
    kv.weights_changed()
    assert all(torch.equal(t, c) for t, c in zip(kv.kv, old_kv.kv))
    tokens, lengths = torch.tensor([c[0] for c in CONT]), torch.tensor([len(p) for p in PROMPTS])
    mixed = kv.decode(tokens, lengths, int(lengths.max()) + 1)  # new weights over the old cache
    assert (mixed - want_new).abs().max() > 1e-2
    assert (mixed - hf_next_logits(old, [p + c for p, c in zip(PROMPTS, one)])).abs().max() > 1e-2


BF16_PACKED = onednn.packable(torch.bfloat16, torch.device("cpu"))


@pytest.mark.skipif(
    not BF16_PACKED, reason="this CPU's torch has no oneDNN bfloat16 products (no AVX-512 or bf16 units)"
)
@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_bf16_products_packed_for_onednn_are_as_close_to_float32_as_the_plain_ones(arch, extra):
    """Packed weights with the residual add and SiLU-times-up in the epilogues: against the same model's
    float32 forward, no further off than the plain bfloat16 forward (which rounds more often)."""
    model = tiny_model(arch, seed=11, **extra)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    want = hf_next_logits(model, [p + c for p, c in zip(PROMPTS, CONT)])
    model = model.to(torch.bfloat16)
    packed, plain = KVForward(model, max_slots=4, init_slots=1, init_capacity=4), KVForward(model, max_slots=4)
    plain.packed = False
    plain.weights_changed()
    assert packed.packed and isinstance(packed.fused[0], PackedLayer) and isinstance(plain.fused[0], FusedLayer)
    err_packed = (run_kv(packed, PROMPTS, CONT) - want).abs().max()
    err_plain = (run_kv(plain, PROMPTS, CONT) - want).abs().max()
    assert err_plain > 0  # bfloat16 arithmetic, not float32's
    assert err_packed <= 1.5 * err_plain, (err_packed, err_plain)


@pytest.mark.skipif(
    not BF16_PACKED, reason="this CPU's torch has no oneDNN bfloat16 products (no AVX-512 or bf16 units)"
)
def test_weights_changed_packs_the_new_weights():
    old, new = tiny_model("qwen2", seed=12).to(torch.bfloat16), tiny_model("qwen2", seed=13).to(torch.bfloat16)
    model = copy.deepcopy(old)
    kv = KVForward(model, max_slots=4)
    one = [c[:1] for c in CONT]
    want = run_kv(KVForward(new, max_slots=4), PROMPTS, one)  # the new weights packed from the start
    apply_weights(model, {n: p.detach().clone() for n, p in new.named_parameters()})
    assert (run_kv(kv, PROMPTS, one) - want).abs().max() > 1e-2  # still the old packed weights
    kv.weights_changed()
    assert torch.equal(run_kv(kv, PROMPTS, one), want)


def test_rope_types_that_rescale_with_length_are_refused():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        KVForward(model, max_slots=2)


def _rows(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[RowSampling]:
    return [RowSampling(temperature, top_p, top_k, None)] * n


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_draws_the_softmax_distribution_and_reports_its_logprobs(temperature):
    vocab, n = 12, 40_000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 3.0, 0.1, -30.0, 1.5, -0.5, 0.2])
    logits = row.expand(n, vocab).contiguous()
    sampler = BatchSampler(_rows(n, temperature), vocab, torch.Generator().manual_seed(0))
    tokens, logprobs = sampler.sample(logits)
    want = torch.softmax(row.double() / temperature, -1)
    freq = _frequencies(tokens, vocab)
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq, want)
    exact = torch.log_softmax(row / temperature, -1)[tokens]
    torch.testing.assert_close(logprobs, exact, atol=1e-6, rtol=0)


def test_sampler_never_draws_filtered_or_impossible_tokens():
    vocab, n = 10, 20_000
    row = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, float("-inf"), 0.5, 0.4, 0.3, 0.2])
    logits = row.expand(n, vocab).contiguous()
    gen = torch.Generator().manual_seed(1)
    tokens, _ = BatchSampler(_rows(n), vocab, gen).sample(logits)
    assert 5 not in tokens.tolist() and len(set(tokens.tolist())) == 9
    tokens, logprobs = BatchSampler(_rows(n, top_k=3), vocab, gen).sample(logits)
    freq = _frequencies(tokens, vocab)
    assert set(tokens.tolist()) == {0, 1, 2}
    want = torch.softmax(row[:3].double(), -1)  # renormalised over the top 3
    assert ((freq[:3] - want).abs() <= 5 * (want * (1 - want) / n).sqrt()).all()
    # the behaviour logprob is the one of the distribution drawn from: renormalised over the top 3
    torch.testing.assert_close(logprobs, torch.log_softmax(row[:3], -1)[tokens], atol=1e-6, rtol=0)


def test_seeded_rows_repeat_and_mix_with_unseeded_ones():
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))

    def rows():
        seeded = [RowSampling(1.0, 1.0, 0, stream_key(7 + i)) for i in range(3)]
        return seeded + _rows(3)

    positions = [10, 11, 12, 0, 0, 0]
    draws = [BatchSampler(rows(), vocab, torch.Generator().manual_seed(s)).sample(logits, positions)[0] for s in (0, 1)]
    assert torch.equal(draws[0][:3], draws[1][:3])  # seeded rows ignore the engine's generator
    moved = BatchSampler(rows(), vocab, torch.Generator().manual_seed(0)).sample(logits, [p + 1 for p in positions])[0]
    assert not torch.equal(moved[:3], draws[0][:3]) or not torch.equal(
        BatchSampler(rows(), vocab, torch.Generator()).sample(logits, [p + 5 for p in positions])[0][:3], draws[0][:3]
    )
    with pytest.raises(ValueError, match="position"):
        BatchSampler(rows(), vocab, torch.Generator()).sample(logits)


def test_two_level_draw_is_the_one_level_draw():
    """Above 4 * CDF_BLOCK tokens the inverse CDF runs in two levels (block sums, then one block):
    with the same uniforms it picks the same tokens as a one-level float64 scan, never a token of
    probability 0 (here whole blocks and the tail block's edges), and reports the same logprobs."""
    from areal_core.rollout.backends.embedded import sampling

    vocab, n = 4 * sampling.CDF_BLOCK + 77, 3000  # a partial tail block
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, 256:512] = float("-inf")  # a whole block impossible
    logits[:, -5:] = float("-inf")  # and the vocabulary's last tokens
    logits[:, ::7] -= 120.0  # weights that underflow to 0 after the max is taken off
    tokens, logprobs = BatchSampler(_rows(n), vocab, torch.Generator().manual_seed(3)).sample(logits)
    u = torch.rand((n, 1), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w = torch.exp(logits - logits.amax(-1, keepdim=True))
    cdf = torch.cumsum(w, -1, dtype=torch.float64)
    want = torch.searchsorted(cdf, u * cdf[:, -1:] * (1 - 2.0**-52), right=True)[:, 0]
    assert torch.equal(tokens, want)
    assert (w.gather(1, tokens[:, None]) > 0).all()
    torch.testing.assert_close(
        logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype,max_abs,max_kl", [(torch.float32, 2e-4, 1e-6), (torch.bfloat16, 0.3, 5e-3)])
def test_engine_logprobs_match_hf_per_dtype(dtype, max_abs, max_kl):
    """The engine's next-token logprobs against HF's own forward in the same dtype, within the tolerance
    stated per dtype (docs/PERFORMANCE.md): float32 agrees to rounding; in bfloat16 each side rounds its
    own intermediate results (fused vs separate projections), so single logprobs differ by tenths of a nat
    while the distributions stay within a KL divergence of a few thousandths."""
    model = tiny_model("llama", seed=3).to(dtype)
    kv = KVForward(model, max_slots=4, init_slots=4, init_capacity=16)
    got = torch.log_softmax(run_kv(kv, PROMPTS, CONT).float(), -1)
    want = torch.log_softmax(hf_next_logits(model, [p + c for p, c in zip(PROMPTS, CONT)]), -1)
    kl = (want.exp() * (want - got)).sum(-1)  # KL(HF || engine) per sequence
    assert float((got - want).abs().max()) <= max_abs, float((got - want).abs().max())
    assert float(kl.max()) <= max_kl, kl.tolist()
