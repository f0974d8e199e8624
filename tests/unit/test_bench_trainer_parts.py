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
