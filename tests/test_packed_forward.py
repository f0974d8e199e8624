"""The packed training forward against plain HF forward passes, one sequence at a time."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from areal_core.trainer.packed_forward import response_logprobs


def _models():
    torch.manual_seed(0)
    q = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     tie_word_embeddings=True))
    l = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                     rope_theta=100000.0, tie_word_embeddings=False))
    return [q, l]


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
    assert ours.shape == ref.shape == (sum(l - s for l, s in zip(lens, starts)),)
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
