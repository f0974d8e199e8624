"""Trainer.step's pi_prox paths: which one runs, and that the log-linear one is wired token by token."""

import math
import random

import pytest
import torch

from areal_core.models import build_char_tokenizer, build_tiny
from areal_core.models.config import TinyArch
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.packed_forward import response_logprobs
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory

VERSION = 1000


def _model():
    return build_tiny(
        TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
        build_char_tokenizer(),
        seed=0,
    )


def _batch(n=12, seed=0, stale=()):
    """n trajectories of mixed lengths; those in ``stale`` were sampled at version 0, the rest at VERSION."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 6))]
        answer = [rng.randrange(3, 40) for _ in range(rng.randint(1, 30))]
        v = 0 if i in stale else VERSION
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=v,
                prompt_ids=prompt,
                output_ids=answer,
                output_logprobs=[-1.0] * len(answer),
                output_versions=[v] * len(answer),
                finish_reason="stop",
                reward=float(i % 2) * 10 - 5,
                correct=None,
            )
        )
    return out


def _trainer(model, **kw):
    cfg = TrainerConfig(
        batch_size=12, max_tokens_per_microbatch=64, optim={"lr": 1e-3, "lr_schedule": "constant"}, **kw
    )
    return Trainer(model, cfg, temperature=1.0, total_steps=10)


@pytest.mark.parametrize(
    "kw, path, prox_passes",
    [
        ({"ppo_minibatches": 1}, "current_forward", 0),
        ({"ppo_minibatches": 1, "prox_logp": "loglinear"}, "current_forward", 0),
        ({"ppo_minibatches": 2}, "recompute", None),
        ({"ppo_minibatches": 2, "prox_logp": "loglinear"}, "loglinear", 0),
        ({"ppo_minibatches": 2, "objective": "naive"}, "none", 0),
    ],
)
def test_step_reports_its_prox_path(kw, path, prox_passes):
    stats = _trainer(_model(), **kw).step(_batch(), VERSION).metrics
    assert stats["prox_logp_path"] == path
    if prox_passes is None:  # one no-grad pass per micro-batch of the whole batch
        assert stats["prox_forward_passes"] >= 2
    else:
        assert stats["prox_forward_passes"] == prox_passes


def test_loglinear_on_fresh_tokens_is_the_naive_update():
    """All tokens sampled by the current version: alpha = 0, pi_prox = pi_behav, so the
    decoupled loss is the naive one and both trainers move the weights identically."""
    a, b = _model(), _model()
    _trainer(a, ppo_minibatches=2, prox_logp="loglinear").step(_batch(), VERSION)
    _trainer(b, ppo_minibatches=2, objective="naive").step(_batch(), VERSION)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


def test_loglinear_uses_each_token_s_own_version():
    """Stale trajectories (alpha = 1000/1001) get pi_prox ~ pi_theta, fresh ones pi_behav. With behaviour
    logprobs one below the model's own, w = exp(prox - behav) is ~e on stale tokens and 1 on fresh ones,
    so the token-weighted mean of w tells whether the versions were lined up with their tokens
    (micro-batching reorders the trajectories)."""
    model = _model()
    stale = {1, 4, 5, 10}
    batch = _batch(stale=stale)
    with torch.no_grad():
        logp = response_logprobs(
            model, [t.prompt_ids + t.output_ids for t in batch], [len(t.prompt_ids) for t in batch]
        ).split([len(t.output_ids) for t in batch])
    for t, lp in zip(batch, logp):
        t.output_logprobs = (lp - 1.0).tolist()
    tr = _trainer(model, ppo_minibatches=2, prox_logp="loglinear")
    tr.optimizer.param_groups[0]["lr"] = 1e-12  # keep pi_theta where it was, across both minibatches
    stats = tr.step(batch, VERSION).metrics
    n_stale = sum(len(t.output_ids) for i, t in enumerate(batch) if i in stale)
    n_all = sum(len(t.output_ids) for t in batch)
    want = (n_all - n_stale + n_stale * math.exp(VERSION / (VERSION + 1))) / n_all
    assert stats["behav_weight_mean"] == pytest.approx(want, rel=1e-4)


def test_loglinear_needs_the_decoupled_objective():
    with pytest.raises(ValueError, match="prox_logp"):
        TrainerConfig(objective="naive", prox_logp="loglinear")
