"""The engine-vs-trainer logprob gap at the behaviour version (step_parts.logprob_gap): only tokens
sampled by the weights the trainer holds count, and it equals the offset put into them."""

from __future__ import annotations

import random

import pytest
import torch

from areal_core.models import build_char_tokenizer, build_tiny
from areal_core.models.config import TinyArch
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.packed_forward import response_logprobs
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory


def batch_with_offsets(model, version: int, offsets: dict[int, float]) -> list[Trajectory]:
    """8 trajectories; those in ``offsets`` were sampled at ``version`` with behaviour logprobs that
    far from the model's; the others at version - 1 with logprobs 3 nats off (which must not count)."""
    rng = random.Random(0)
    batch = []
    for i in range(8):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 6))]
        answer = [rng.randrange(3, 40) for _ in range(rng.randint(3, 25))]
        v = version if i in offsets else version - 1
        batch.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=v,
                prompt_ids=prompt,
                output_ids=answer,
                output_logprobs=[0.0] * len(answer),
                output_versions=[v] * len(answer),
                finish_reason="stop",
                reward=float(i % 2),
            )
        )
    with torch.no_grad():
        logp = response_logprobs(
            model, [t.prompt_ids + t.output_ids for t in batch], [len(t.prompt_ids) for t in batch]
        ).split([len(t.output_ids) for t in batch])
    for i, (t, lp) in enumerate(zip(batch, logp)):
        t.output_logprobs = (lp.double() + offsets.get(i, 3.0)).tolist()
    return batch


@pytest.mark.parametrize("minibatches", [1, 2])  # the current forward's pi_prox, and the recomputed one
def test_the_gap_counts_same_version_tokens_only(minibatches):
    model = build_tiny(
        TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
        build_char_tokenizer(),
        seed=0,
    )
    offsets = {0: 0.25, 3: -0.25, 5: 0.25}
    batch = batch_with_offsets(model, 4, offsets)
    cfg = TrainerConfig(
        batch_size=8,
        max_tokens_per_microbatch=48,
        ppo_minibatches=minibatches,
        optim={"lr": 1e-12, "lr_schedule": "constant"},
    )
    m = Trainer(model, cfg, temperature=1.0, total_steps=1).step(batch, 4).metrics
    assert m["logprob_gap_tokens_sum"] == sum(len(batch[i].output_ids) for i in offsets)
    assert m["logprob_gap_mean"] == pytest.approx(0.25, abs=1e-5)
    assert m["logprob_gap_max"] == pytest.approx(0.25, abs=1e-5)


def test_no_token_at_the_trainers_version_gives_no_mean():
    model = build_tiny(
        TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
        build_char_tokenizer(),
        seed=0,
    )
    batch = batch_with_offsets(model, 4, {})
    m = (
        Trainer(model, TrainerConfig(batch_size=8, max_tokens_per_microbatch=48), temperature=1.0, total_steps=1)
        .step(batch, 4)
        .metrics
    )
    assert m["logprob_gap_tokens_sum"] == 0 and "logprob_gap_mean" not in m
