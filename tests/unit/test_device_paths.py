"""Device placement that a CPU can check: the rollout server receives distributed weight updates on
the engine's device (NCCL moves GPU tensors only), a CPU engine refuses NCCL before any rendezvous,
and the megatron trainer names the devices it runs on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_core.rollout.backends.embedded.server import create_app
from areal_core.rollout.backends.embedded.weight_receiver import DistributedReceiver
from areal_core.rollout.weight_layout import TensorSpec


class _RecordingGroup:
    """A process group stand-in: records where each broadcast's tensor lives."""

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def broadcast(self, tensor: torch.Tensor, root: int):
        assert root == 0
        self.devices.append(tensor.device)
        return SimpleNamespace(wait=lambda: True)


SPECS = [TensorSpec("a.weight", "bfloat16", (4, 3)), TensorSpec("b.bias", "float32", (5,))]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_receiver_allocates_on_its_device(device):
    """``meta`` stands in for a GPU here: the buffers go wherever the receiver was told, and nowhere else."""
    rx = DistributedReceiver(device)
    group = _RecordingGroup()
    rx._groups["g"] = group
    got = rx.receive("g", SPECS)
    assert group.devices == [torch.device(device)] * 2
    assert {n: (t.device.type, t.dtype, tuple(t.shape)) for n, t in got.items()} == {
        "a.weight": (device, torch.bfloat16, (4, 3)),
        "b.bias": (device, torch.float32, (5,)),
    }


@pytest.mark.parametrize("device", ["cpu", "meta", "cuda"])
def test_the_server_receives_on_the_engines_device(device):
    """create_app builds its receiver on the device the engine reports (the engine is not touched)."""
    engine = SimpleNamespace(device=torch.device(device))
    app = create_app(engine)
    assert app.state.parts.receiver.device == torch.device(device)


def test_a_real_engine_on_the_cpu_gives_a_cpu_receiver():
    from areal_core.rollout.backends.embedded.engine import RolloutEngine
    from tests.e2e.test_rollout_server import tiny_qwen2

    engine = RolloutEngine(tiny_qwen2(3), start=False)
    try:
        assert engine.device == torch.device("cpu")
        assert create_app(engine).state.parts.receiver.device == torch.device("cpu")
    finally:
        engine.shutdown()


def test_nccl_is_refused_by_a_cpu_engine_before_any_rendezvous():
    """No store is contacted (the port is closed): the refusal names the device and the way out."""
    rx = DistributedReceiver("cpu")
    with pytest.raises(ValueError, match=r"'nccl' moves GPU tensors only.*runs on cpu: use backend 'gloo'"):
        rx.init_group("127.0.0.1", 1, 1, 2, "g", "nccl", timeout_s=1.0)
    assert rx._groups == {}


def test_a_group_never_joined_is_named():
    with pytest.raises(ValueError, match="no weight-update group 'nope'"):
        DistributedReceiver("cpu").receive("nope", SPECS)


def test_the_megatron_engine_names_the_devices_it_runs_on():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra)")
    from transformers import Qwen2Config

    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.megatron.engine import MegatronEngine

    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=40,
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda', not 'mps'"):
        MegatronEngine(cfg, TrainerConfig(batch_size=8), 1.0, 1, 1, device="mps")


@pytest.mark.parametrize(
    "device,backend,current", [("cpu", "gloo", None), ("cuda", "nccl", "cuda:0"), ("cuda:1", "nccl", "cuda:1")]
)
def test_the_megatron_trainer_joins_with_the_backend_of_its_device(monkeypatch, device, backend, current):
    """Rank 0 makes its GPU current, then asks for an NCCL group (gloo on the CPU): the process group
    and the engine must agree, or the engine's init_parallel would meet a group of another backend."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra)")
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.megatron import parallel
    from areal_core.trainer.megatron.trainer import MegatronTrainer

    calls = []

    class Stop(Exception):
        pass

    def init_parallel(tp, backend="gloo"):
        calls.append(("init_parallel", tp, backend))
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(parallel, "init_parallel", init_parallel)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(Stop):
        MegatronTrainer(SimpleNamespace(config=None), TrainerConfig(batch_size=8), 1.0, 1, device=device)
    want = ([("set_device", current)] if current else []) + [("init_parallel", 1, backend)]
    assert calls == want
