"""bench/trainer_parts.py times the parts of the real ``Trainer.step`` by wrapping the calls the step
makes: every part is seen, they add up to no more than the step, and the wrappers go afterwards."""

import random
import time

import torch

from bench import trainer_parts
from bench.models import build_tiny_model


def test_the_parts_of_a_step_are_timed_and_the_trainer_is_left_as_it_was():
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer

    model, tok = build_tiny_model(seed=0)
    model = model.to(torch.bfloat16)  # a working copy with float32 masters: every part has work
    tr = Trainer(model, TrainerConfig(batch_size=8, microbatching="dynamic"), temperature=1.0, total_steps=10)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    batch = trainer_parts._batch(tok, prompts, 4, 12, random.Random(0))
    assert len(batch) == 8 and {t.reward for t in batch} == {5.0, -5.0}
    before = {name: vars(obj).get(name) for obj, name in ((tr.optimizer, "step"), (tr, "_logprobs"))}
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_

    times = trainer_parts.PartTimes()
    with times.timing(tr):
        t0 = time.perf_counter()
        tr.step(batch, 0)
        total = time.perf_counter() - t0
    assert all(times.s[p] > 0 for p in trainer_parts.PARTS), times.s
    assert sum(times.s.values()) < total

    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip
    assert {name: vars(obj).get(name) for obj, name in ((tr.optimizer, "step"), (tr, "_logprobs"))} == before
    seen = dict(times.s)
    tr.step(batch, 0)  # outside the block nothing is timed
    assert times.s == seen


def test_the_prompt_attention_pairs_time_both_ways_and_leave_the_trainers_attention():
    """Each batch is stepped twice: once through the trainer's attention (answers bring fewer queries
    than keys), once through the whole-sequence form, which never calls it; afterwards the trainer's
    attention is what it was."""
    from areal_core.trainer import packed_forward
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer

    model, tok = build_tiny_model(seed=0)
    tr = Trainer(model, TrainerConfig(batch_size=8, microbatching="dynamic"), temperature=1.0, total_steps=10)
    own = packed_forward.packed_causal_attention
    calls = []

    def counting(q, k, v, lens, scale, key_lens=None):  # the trainer's own attention, counted
        calls.append(list(key_lens) != list(lens))
        return own(q, k, v, lens, scale, key_lens)

    rng = random.Random(0)
    batches = [trainer_parts._batch(tok, [[5, 6, 7, 8], [9, 10, 11]], 4, 12, rng) for _ in range(3)]
    packed_forward.packed_causal_attention = counting
    try:
        tr.step(batches[0], 0)
        per_step = len(calls)
        s = trainer_parts._attention_pairs(tr, batches[1:])
        assert packed_forward.packed_causal_attention is counting
    finally:
        packed_forward.packed_causal_attention = own
    assert len(s["once"]) == len(s["per_answer"]) == 2 and min(s["once"] + s["per_answer"]) > 0
    assert per_step > 0 and all(calls) and len(calls) == 3 * per_step  # the two "once" steps only


def test_timed_pairs_give_the_slow_over_fast_ratio_pair_by_pair(capsys):
    timed = trainer_parts._Pairs({1: {"loop": [4.0, 9.0, 2.0], "fused": [2.0, 3.0, 2.0]}}, "loop", "fused")
    result = timed.result()["1"]
    assert result["loop_over_fused"]["median"] == 2.0
    assert (result["loop_over_fused"]["min"], result["loop_over_fused"]["max"]) == (1.0, 3.0)
    assert result["loop_s"]["median"] == 4.0 and result["fused_s"]["median"] == 2.0
    assert timed.summary("x") == {"x_1t": 2.0}
    timed.print(["loop s", "fused s"], "title")
    assert "loop / fused (median)" in capsys.readouterr().out
