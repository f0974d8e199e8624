"""Embedded servers run in the trainer's model dtype; in-memory weight pushes arrive in it exactly,
and a push in another dtype is refused by name instead of being converted."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from areal_core.experiment import ExperimentConfig
from areal_core.rollout.backends import make_backend
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.weight_transport import DistributedTransport, TensorTransport
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory
from tests.e2e.test_rollout_server import VOCAB, tiny_qwen2
from tests.e2e.test_weight_transport import _server_weights

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    """One embedded server started as run.py starts them for ``model.dtype: bfloat16``, from a
    float32 checkpoint whose values are not all representable in bfloat16."""
    root = tmp_path_factory.mktemp("bf16")
    v0 = tiny_qwen2(21)
    v0.save_pretrained(root / "v0")
    cfg = ExperimentConfig.model_validate({"model": {"dtype": "bfloat16"}})
    backend = make_backend(
        cfg.rollout, engine=cfg.rollout.engine_config(seed=cfg.seed, dtype=cfg.model.dtype), log_dir=root
    )
    with backend.launch(str(root / "v0"), 0) as urls:
        yield urls[0], v0


def _names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def test_server_runs_in_the_configured_dtype(bf16_server):
    url, v0 = bf16_server
    got = asyncio.run(_server_weights(url, _names(v0)))
    for name, p in v0.named_parameters():
        want = p.detach().flatten()
        assert torch.equal(got[name], want.to(BF16).float()), name
    assert not all(torch.equal(got[n], p.detach().flatten()) for n, p in v0.named_parameters())


def _batch() -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(8):
        answer = [rng.randrange(4, VOCAB) for _ in range(6)]
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=0,
                prompt_ids=[rng.randrange(4, VOCAB) for _ in range(3)],
                output_ids=answer,
                output_logprobs=[-4.0] * len(answer),
                output_versions=[0] * len(answer),
                finish_reason="stop",
                reward=float(i % 2) * 10 - 5,
                correct=None,
            )
        )
    return out


async def _push(transport, url: str, model, version: int) -> None:
    client = EmbeddedClient(url)
    try:
        await transport.connect([client])
        transport.stage(model, version)
        await transport.push([client])
    finally:
        transport.close()
        await client.aclose()


@pytest.mark.parametrize("transport", [TensorTransport, DistributedTransport])
def test_push_from_fp32_masters_lands_rounded_on_a_bf16_server(bf16_server, transport):
    url, _ = bf16_server
    model = tiny_qwen2(5).to(BF16)
    trainer = Trainer(model, TrainerConfig(batch_size=8, optim={"lr": 1e-3, "lr_schedule": "constant"}), 1.0, 10)
    for _ in range(2):
        trainer.step(_batch(), version=0)
    asyncio.run(_push(transport(), url, model, 7))
    got = asyncio.run(_server_weights(url, _names(model)))
    for name, master in trainer.named_masters().items():
        assert master.dtype == torch.float32
        assert torch.equal(got[name], master.detach().to(BF16).float().flatten()), name


@pytest.mark.parametrize("transport", [TensorTransport, DistributedTransport])
def test_push_in_another_dtype_is_refused_by_name(bf16_server, transport):
    url, _ = bf16_server
    name = "lm_head.weight"
    before = asyncio.run(_server_weights(url, [name]))[name]
    with pytest.raises(RolloutServerError, match=r"weight.* arrives as float32, the server's model is bfloat16"):
        asyncio.run(_push(transport(), url, tiny_qwen2(6), 8))
    assert torch.equal(asyncio.run(_server_weights(url, [name]))[name], before)
