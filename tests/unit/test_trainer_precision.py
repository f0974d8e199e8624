"""A bfloat16 model trains on float32 master weights: small updates accumulate instead of
rounding away, and what the model (the published copy) holds is the masters' rounding."""

import random

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny random Qwen2 whose weights all have magnitude 0.04-0.06 (a bfloat16 step there is 2.4e-4)."""
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=48,
        max_position_embeddings=128,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.04, 0.06).mul_(torch.randint(0, 2, p.shape) * 2 - 1)
    return model.to(dtype)


def _batch(seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(8):
        answer = [rng.randrange(3, 40) for _ in range(8)]
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=0,
                prompt_ids=[rng.randrange(3, 40) for _ in range(4)],
                output_ids=answer,
                output_logprobs=[-3.8] * len(answer),
                output_versions=[0] * len(answer),
                finish_reason="stop",
                reward=float(i % 2) * 10 - 5,
                correct=None,
            )
        )
    return out


def _trainer(model) -> Trainer:
    cfg = TrainerConfig(batch_size=8, optim={"lr": 2e-5, "lr_schedule": "constant"})
    return Trainer(model, cfg, temperature=1.0, total_steps=10)


def _share_changed(now: dict, before: dict) -> float:
    return sum(int((now[n] != before[n]).sum()) for n in before) / sum(t.numel() for t in before.values())


def test_bf16_model_trains_on_fp32_masters():
    model = _model(torch.bfloat16)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    trainer = _trainer(model)
    for step in range(10):
        trainer.step(_batch(step), version=0)
    masters = trainer.named_masters()
    assert all(m.dtype == torch.float32 for m in masters.values())
    # each update (~lr = 2e-5) is under half a bf16 step: the masters keep them all ...
    assert _share_changed(masters, start) > 0.9
    # ... and the bf16 model, their rounding, moves where they crossed a rounding boundary
    model_now = {n: p.detach().float() for n, p in model.named_parameters()}
    assert _share_changed(model_now, start) > 0.01
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), name


def test_masters_survive_a_resume():
    """The trainer state holds the float32 masters: a resumed trainer (its model loaded from the bf16
    checkpoint) continues from them, not from their rounding."""
    model = _model(torch.bfloat16)
    trainer = _trainer(model)
    for step in range(3):
        trainer.step(_batch(step), version=0)
    state = trainer.state_dict()

    resumed_model = _model(torch.bfloat16)
    resumed_model.load_state_dict(model.state_dict())  # what the checkpoint holds
    resumed = _trainer(resumed_model)
    resumed.load_state_dict(state)
    for name, m in trainer.named_masters().items():
        assert torch.equal(resumed.named_masters()[name], m), name
    a, b = trainer.step(_batch(3), version=0), resumed.step(_batch(3), version=0)
    assert a.metrics["loss"] == b.metrics["loss"]
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_fp32_model_is_its_own_master():
    model = _model(torch.float32)
    trainer = _trainer(model)
    assert all(m is p for m, p in zip(trainer.named_masters().values(), model.parameters()))
    assert "master_weights" not in trainer.state_dict()
