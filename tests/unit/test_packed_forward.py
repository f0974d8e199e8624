"""The packed training forward against plain HF forward passes, one sequence at a time."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from areal_core.trainer.packed_forward import response_logprobs


def _models():
    torch.manual_seed(0)
    q = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=50,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        )
    )
    return [q, _llama(2)]


def _llama(layers: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_theta=100000.0,
            tie_word_embeddings=False,
        )
    )


def _reference(model, seqs, starts, temperature):
    out = []
    for s, st in zip(seqs, starts):
        logits = model(torch.tensor([s])).logits[0].double() / temperature
        lp = torch.log_softmax(logits, -1)
        out.append(torch.stack([lp[t - 1, s[t]] for t in range(st, len(s))]))
    return torch.cat(out)


@pytest.mark.parametrize("model", _models(), ids=["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_hf_forward(model, temperature):
    g = torch.Generator().manual_seed(1)
    lens = [5, 17, 1 + 2, 40, 9]
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lens]
    starts = [2, 10, 1, 30, 8]
    ours = response_logprobs(model, seqs, starts, temperature)
    ref = _reference(model, seqs, starts, temperature)
    assert ours.shape == ref.shape == (sum(n - s for n, s in zip(lens, starts)),)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("model", _models(), ids=["qwen2", "llama"])
def test_gradients_match_hf(model):
    g = torch.Generator().manual_seed(2)
    lens, starts = [6, 3, 33, 6, 2, 12], [3, 1, 20, 5, 1, 4]
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lens]
    weights = torch.randn(sum(n - s for n, s in zip(lens, starts)), generator=g)  # a loss that weighs each token
    model.zero_grad()
    (response_logprobs(model, seqs, starts, 0.8) * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (_reference(model, seqs, starts, 0.8) * weights.double()).sum().backward()
    for n, p in model.named_parameters():
        assert ours[n].abs().max() > 0, n
        torch.testing.assert_close(ours[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def _grouped(g):
    """Answers to shared prompts, interleaved with unshared ones and a prompt that prefixes another."""
    p1 = torch.randint(0, 50, (7,), generator=g).tolist()
    p2 = torch.randint(0, 50, (4,), generator=g).tolist()
    ans = lambda n: torch.randint(0, 50, (n,), generator=g).tolist()  # noqa: E731
    seqs = [p1 + ans(5), p2 + ans(1), p1 + ans(9), p1[:4] + ans(6), p1 + ans(1), p2 + ans(12), ans(3) + ans(2)]
    starts = [7, 4, 7, 4, 7, 4, 3]
    return seqs, starts


@pytest.mark.parametrize("model", _models(), ids=["qwen2", "llama"])
def test_shared_prompts_match_hf(model):
    """A prompt shared by several answers enters the stream once; every answer still scores as if alone,
    and the gradients (summed over the answers through the shared prompt) are the separate copies' sum."""
    from areal_core.trainer.packed_forward import _layout

    g = torch.Generator().manual_seed(3)
    seqs, starts = _grouped(g)
    lay = _layout(seqs, starts)
    assert len(lay.ids) == sum(len(s) for s in seqs) - 2 * 7 - 4  # p1 stored once (not 3x), p2 once (not 2x)
    # each prompt attends to itself once, then each of its answers' queries to the prompt and itself
    assert lay.queries == [7, 5, 9, 1, 4, 1, 12, 4, 6, 3, 2] and sum(lay.queries) == len(lay.ids)
    assert (
        lay.keys == [7, 12, 16, 8, 4, 5, 16, 4, 10, 3, 5]
        and lay.gather is not None
        and len(lay.gather) == sum(lay.keys)
    )
    ours = response_logprobs(model, seqs, starts, 0.9)
    ref = _reference(model, seqs, starts, 0.9)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=0)

    weights = torch.randn(ours.numel(), generator=g)
    model.zero_grad()
    (response_logprobs(model, seqs, starts, 0.9) * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (ref * weights.double()).sum().backward()
    for n, p in model.named_parameters():
        assert got[n].abs().max() > 0, n
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_gradients_do_not_depend_on_the_thread_count():
    """Several answers to one prompt are scored from the same hidden state; their gradients meet there.
    Summed by advanced-indexing backward, the sum's order followed the thread split; index_select's
    backward adds them in stream order on any number of threads, so a replay on more threads than the
    original trainer had (``areal-flow replay``) reproduces its weights bit for bit."""
    model = _models()[0]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 50, (30,), generator=g).tolist() for _ in range(16)]
    seqs = [
        p + torch.randint(0, 50, (int(torch.randint(10, 40, (1,), generator=g)),), generator=g).tolist()
        for p in prompts
        for _ in range(8)
    ]
    starts = [30] * len(seqs)
    weights = torch.randn(sum(len(s) - 30 for s in seqs), generator=g)
    before = torch.get_num_threads()
    grads = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            model.zero_grad()
            (response_logprobs(model, seqs, starts, 1.0) * weights).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(before)
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[2][n]), n  # (the same run twice)
        assert torch.equal(grads[0][n], grads[1][n]), f"{n}: 1 and 2 threads give different gradients"


def test_response_start_outside_the_sequence_is_an_error():
    model = _models()[0]
    with pytest.raises(ValueError, match="sequence 1: response start 4"):
        response_logprobs(model, [[1, 2, 3], [1, 2, 3, 4]], [1, 4])


def test_trainer_and_engine_forwards_agree_on_a_mistral_decoder():
    """One decoder check and one rotary form: a model the packed forward trains (here Mistral,
    with a non-default rope base) is one the engine serves, and both score a sequence as HF does."""
    from transformers import MistralConfig, MistralForCausalLM

    from areal_core.rollout.backends.embedded.kv_forward import KVForward

    torch.manual_seed(1)
    m = MistralForCausalLM(
        MistralConfig(
            vocab_size=50,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            sliding_window=None,
            rope_theta=5000.0,
        )
    ).eval()
    seq, start = [3, 9, 14, 2, 7, 7, 30, 41], 3
    want = _reference(m, [seq], [start], 1.0)
    with torch.no_grad():
        trained = response_logprobs(m, [seq], [start]).double()
        kv = KVForward(m, max_slots=1)
        kv.ensure(1, len(seq))
        logits = [kv.prefill([0], [seq[:start]])[0]]
        lengths = torch.tensor([start])
        for t in seq[start:-1]:
            logits.append(kv.decode(torch.tensor([t]), lengths, int(lengths.max()) + 1)[0])
            lengths += 1
        served = torch.log_softmax(torch.stack(logits).double(), -1)[torch.arange(len(seq) - start), seq[start:]]
    torch.testing.assert_close(trained, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(served, want, atol=1e-4, rtol=0)


def _deep_bf16_model():
    """A 12-layer Llama in bfloat16 (the trainer's working copy), and the same weights in float64."""
    torch.manual_seed(5)
    low = _llama(12).to(torch.bfloat16)
    exact = LlamaForCausalLM(low.config).double()
    exact.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    return low, exact


def test_a_bfloat16_model_trains_on_a_float32_residual_stream():
    """A bfloat16 model's products run in bfloat16 and its residual stream in float32: its logprobs and
    gradients lie closer to the exact arithmetic of its own weights (float64) than those of a forward
    that rounds the residual stream to bfloat16 after every layer (HF's bfloat16 forward)."""
    low, exact = _deep_bf16_model()
    g = torch.Generator().manual_seed(6)
    lens, starts = [30, 41, 25, 37], [10, 12, 8, 20]
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lens]
    weights = torch.randn(sum(n - s for n, s in zip(lens, starts)), generator=g)

    def grads(model, lp):
        model.zero_grad()
        (lp * weights.to(lp.dtype)).sum().backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()]), lp.detach().double()

    g_ours, lp_ours = grads(low, response_logprobs(low, seqs, starts, 0.8))
    g_bf16, lp_bf16 = grads(low, _reference(low, seqs, starts, 0.8))
    g_exact, lp_exact = grads(exact, _reference(exact, seqs, starts, 0.8))
    err = lambda x, ref: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(lp_ours, lp_exact) < 0.8 * err(lp_bf16, lp_exact)  # 0.51 measured; near 1 with a bf16 stream
    assert err(g_ours, g_exact) < 0.8 * err(g_bf16, g_exact)  # 0.58 measured; near 1 with a bf16 stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3 * 1000, 1 << 20])  # one row at a time, 3 (last chunk partial), all
def test_the_lm_heads_chunked_target_logprobs_give_autograds_bits(monkeypatch, dtype, temperature, chunk):
    """The LM head's target log-probabilities and their gradients, a few rows at a time, are bit for
    bit what upcast, scale, log_softmax and gather give under autograd on the whole micro-batch."""
    from areal_core.trainer import packed_forward

    monkeypatch.setattr(packed_forward, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    n, hidden, vocab = 11, 32, 1000
    h0 = torch.randn(n, hidden, generator=g).to(dtype)
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    up = torch.randn(n, generator=g)
    results = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logits = torch.nn.functional.linear(h, w)
        if fused:
            lp = packed_forward._TargetLogprobs.apply(logits, targets, temperature)
        else:
            lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
        lp.backward(up)
        results.append((lp.detach(), h.grad, w.grad))
    for name, a, b in zip(("logprobs", "hidden grad", "weight grad"), *results):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert results[1][0].dtype == torch.float32
    assert results[1][1].abs().sum() > 0 and results[1][2].abs().sum() > 0


def test_the_lm_head_runs_as_the_models_own_module():
    """Hooks on the LM head (core lending's thread count, an adapter's) see its forward and its
    output's gradient, as for every other linear layer."""
    model = _llama(1)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.append("forward"))

    def after(module, args, out):
        out.register_hook(lambda g: seen.append("backward"))

    model.lm_head.register_forward_hook(after)
    response_logprobs(model, [[1, 2, 3, 4], [5, 6, 7]], [2, 1], 0.7).sum().backward()
    assert seen == ["forward", "backward"]
