"""A real rollout controller over a real rollout server (a tiny random Qwen2) and a real Dask reward
service, whose answers' text is scripted: for tests of what grading makes of given answers on the
controller's own path (admission, the reward service's batches, the buffer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from areal_core.controller import ControllerSettings, Servers
from areal_core.controller.assemble import make_controller
from areal_core.reward.config import RewardConfig
from areal_core.types import Prompt


def tiny_qwen2_folder(folder: Path) -> str:
    """A random one-layer Qwen2 (vocabulary 64, EOS 3) saved at ``folder``; its path."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=128,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


def graded_batches(
    tmp_path: Path,
    prompts: list[Prompt],
    decode: Callable[[list[int]], str],
    settings: ControllerSettings,
    reward: RewardConfig,
    n_batches: int,
    max_running: int,
):
    """``n_batches`` batches of ``settings.batch_size`` graded answers taken from the buffer while the
    controller runs (version 0, the settings' eta), and the reward service (closed) they went through."""
    from areal_core.controller.buffer import ReplayBuffer
    from areal_core.reward.service import RewardService
    from areal_core.rollout.backends.embedded.launcher import start_server
    from areal_core.rollout.weight_transport import DiskTransport

    model = tiny_qwen2_folder(tmp_path / "m")
    buffer = ReplayBuffer()
    with RewardService(reward) as rewards, start_server(model, weight_version=0, max_running=max_running) as srv:
        controller = make_controller(
            Servers([srv.url], model_path=model),
            prompts,
            decode,
            rewards,
            buffer,
            settings,
            DiskTransport(str(tmp_path / "w")),
            version=0,
        )
        controller.start()
        try:
            batches = [
                buffer.take(settings.batch_size, version=0, eta=settings.eta, timeout=120) for _ in range(n_batches)
            ]
        finally:
            controller.stop()
    return batches, rewards
