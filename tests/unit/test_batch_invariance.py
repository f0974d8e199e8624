"""Keyed sampling and the engine's batch-invariant mode: a seeded answer's tokens and logprobs
do not depend on which other requests ran beside it, nor on being continued from a prefix."""

from __future__ import annotations

import random

import pytest
import torch

from areal_core.controller.generation import trajectory_seed
from areal_core.rollout.backends.embedded.engine import RolloutEngine
from areal_core.rollout.backends.embedded.sampling import keyed_uniform, stream_key
from tests.unit.test_engine import run_to_end, tiny_model

SEEDED = {"temperature": 1.0, "max_new_tokens": 140, "sampling_seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden_size=128, intermediate_size=256, vocab_size=64)


@pytest.fixture(scope="module")
def wide_groups():
    """Six query heads per KV head (more than one attention call takes in the mode)."""
    return tiny_model(
        "llama", hidden_size=192, intermediate_size=256, vocab_size=64, num_attention_heads=12, num_key_value_heads=2
    )


def generate(model, jobs, late=(), after=0, invariant=True):
    """Run ``jobs``; ``late`` ones join after ``after`` engine steps (a batch that changes under them)."""
    engine = RolloutEngine(model, start=False, max_running=64, batch_invariant=invariant)
    futs = engine.submit_many(jobs)
    for _ in range(after):
        engine.step()
    if late:
        futs += engine.submit_many(list(late))
    run_to_end(engine)
    return [f.result() for f in futs]


def answer(resp):
    return resp.output_ids, [lp for lp, _, _ in resp.meta_info.output_token_logprobs]


def neighbours(rng: random.Random, k: int):
    return [
        (
            [rng.randrange(4, 64) for _ in range(rng.randrange(1, 150))],
            {"temperature": 1.0, "max_new_tokens": rng.randrange(1, 200), "ignore_eos": True},
            None,
        )
        for _ in range(k)
    ]


def test_keyed_uniform_depends_on_key_and_position_only():
    k = stream_key(7)
    us = [keyed_uniform(k, p) for p in range(2000)]
    assert us == [keyed_uniform(stream_key(7), p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert len(set(us)) == len(us)
    assert abs(sum(us) / len(us) - 0.5) < 0.03  # roughly uniform
    assert [keyed_uniform(stream_key(8), p) for p in range(5)] != us[:5]
    # trajectory seeds: stable, distinct per trajectory and per run seed, within the wire's 63 bits
    seeds = {trajectory_seed(s, f"e0-p{p}-s{i}") for s in (0, 1) for p in range(50) for i in range(8)}
    assert len(seeds) == 800 and max(seeds) < 1 << 63
    assert trajectory_seed(0, "e0-p1-s2") == trajectory_seed(0, "e0-p1-s2")


@pytest.mark.parametrize("threads", [1])  # the engine's default torch_threads
@pytest.mark.parametrize("which", ["model", "wide_groups"])
def test_a_seeded_answer_is_the_same_in_any_batch(request, which, threads):
    """Alone, among 1-30 others of other lengths, with others joining mid-way: the same tokens and the
    same logprobs bit for bit (batch-invariant mode)."""
    model = request.getfixturevalue(which)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(threads)
        prompt = [rng.randrange(4, 64) for _ in range(20)]
        alone = answer(generate(model, [(prompt, SEEDED, "x")])[0])
        for trial in range(6):
            others = neighbours(rng, rng.randrange(1, 30))
            late = neighbours(rng, rng.randrange(1, 10)) if trial % 2 else ()
            half = len(others) // 2
            resp = generate(model, others[:half] + [(prompt, SEEDED, "x")] + others[half:], late, after=trial * 3)[half]
            assert answer(resp) == alone, f"trial {trial}: the answer changed with its neighbours"
    finally:
        torch.set_num_threads(before)


def test_a_continued_answer_draws_the_same_tokens(model):
    """Continued from its first 30 tokens (as after a server failure), a seeded answer draws the same
    tokens: each token's uniform depends on its position, not on how many were drawn before."""
    rng = random.Random(3)
    prompt = [rng.randrange(4, 64) for _ in range(12)]
    whole = generate(model, [(prompt, SEEDED, "x")])[0].output_ids
    rest = generate(model, [(prompt + whole[:30], {**SEEDED, "max_new_tokens": SEEDED["max_new_tokens"] - 30}, "x")])[0]
    assert whole[:30] + rest.output_ids == whole


def test_without_the_mode_batches_change_the_numbers(model):
    """The default mode's arithmetic follows the batch (why the mode exists): some trial differs, with
    grouped-query attention or with one KV head per query head (which of the two shows it follows the
    CPU kind's kernels: on an Intel Xeon with AMX only the latter did). If this fails, this machine's
    kernels are batch-invariant already for both (docs/PERFORMANCE.md)."""
    mha = tiny_model("llama", hidden_size=128, intermediate_size=256, vocab_size=64, num_key_value_heads=4)
    differs = []
    for m in (model, mha):
        rng = random.Random(5)
        prompt = [rng.randrange(4, 64) for _ in range(20)]
        alone = answer(generate(m, [(prompt, SEEDED, "x")], invariant=False)[0])
        for _ in range(3):
            others = neighbours(rng, 20)
            together = generate(m, others[:10] + [(prompt, SEEDED, "x")] + others[10:], invariant=False)[10]
            differs.append(answer(together) != alone)
    assert any(differs)
