"""The attention options the benchmarks time instead of the trainer's own compute what it computes."""

import pytest
import torch

from areal_core.trainer.packed_attention import packed_causal_attention
from bench.attention_options import OPTIONS, on_whole_sequences


@pytest.mark.parametrize("name", [n for n in OPTIONS if "trainer" not in n])
def test_an_option_on_whole_sequences_gives_the_trainers_attention_where_answers_share_a_prompt(name):
    """A prompt's answers bring only their own queries; the option then gets whole sequences (zeros for
    the queries the trainer has not) and the trainer's queries' outputs and gradients are as its own."""
    lens, key_lens = [6, 3, 5, 6], [6, 9, 11, 6]  # a prompt of 6 and two answers, then an unshared sequence
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens), 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(key_lens), 2, 8, generator=g, requires_grad=True) for _ in range(2))
    theirs = on_whole_sequences(OPTIONS[name])(q, k, v, lens, 0.3, key_lens)
    ours = packed_causal_attention(q, k, v, lens, 0.3, key_lens)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4)
    grad = torch.randn(ours.shape, generator=g)
    for a, b in zip(torch.autograd.grad(theirs, (q, k, v), grad), torch.autograd.grad(ours, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
