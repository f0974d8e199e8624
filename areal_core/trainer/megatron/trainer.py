"""``MegatronTrainer``: the torch ``Trainer``'s public surface on a megatron-core GPTModel.

Rank 0 of a ``torchrun`` job (or a process alone) builds it from the Hugging Face model the run
publishes, exactly as it builds ``Trainer(model, cfg, temperature, total_steps)``; every other rank
runs :func:`areal_core.trainer.megatron.follower.follow` instead. Each public call on rank 0 first
broadcasts itself as a command, then does its own part of the collective work
(:class:`~areal_core.trainer.megatron.engine.MegatronEngine`).

The HF model stays the published working copy: after every step (and a resume) rank 0 gathers the
float32 weights from the tensor-parallel shards and copies them into it (rounded to its dtype), so
checkpoints and the weight transport (``transport.stage(model, version)``) need no change. The
megatron module computes in float32, on ``device`` (``cpu``, or ``cuda``: this rank's GPU, NCCL). Other
ranks' followers join over gloo (``follower.follow``): tensor or data parallelism over GPUs is not
wired yet, only one GPU alone.
"""

from __future__ import annotations

import torch

from areal_core.trainer.base import StepResult
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.megatron import mapping, parallel
from areal_core.trainer.megatron.engine import MegatronEngine
from areal_core.types import Trajectory


class MegatronTrainer:
    def __init__(
        self,
        model,
        cfg: TrainerConfig,
        temperature: float,
        total_steps: int,
        tp_size: int = 1,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.model = model
        init = (model.config, cfg, temperature, total_steps, tp_size, seed, device)
        self.engine = None
        _, backend = parallel.use_device(device)  # (a GPU: NCCL, and this rank's GPU made current first)
        layout = parallel.init_parallel(tp_size, backend=backend)  # rank 0 of the job from here on
        if layout.rank != 0:
            raise RuntimeError(
                f"MegatronTrainer is built on rank 0 only; rank {layout.rank} must run "
                "areal_core.trainer.megatron.follower.follow()"
            )
        try:  # a clear error here, before the followers build anything; they are released with it
            self._check(model, tp_size)
        except (ValueError, NotImplementedError):
            parallel.send_command("stop")
            raise
        parallel.send_command("init", *init)
        self.engine = MegatronEngine(*init)
        parallel.send_command("load_hf")
        self.engine.load_hf({n: p.detach() for n, p in model.named_parameters()})
        self.cfg, self.temperature, self.layout = cfg, temperature, layout

    @staticmethod
    def _check(model, tp_size: int) -> None:
        arch = mapping.arch_of(model.config, tp_size)
        have = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if have != mapping.hf_shapes(arch):
            diff = sorted(set(have.items()) ^ set(mapping.hf_shapes(arch).items()))
            raise ValueError(
                f"the {arch.model_type} model's parameters are not what its config maps to "
                f"(first differences: {diff[:3]})"
            )

    def _call(self, name: str, *args):
        parallel.send_command(name, *args)
        return getattr(self.engine, name)(*args)

    def step(self, batch: list[Trajectory], version: int) -> StepResult:
        """One training step on ``batch`` by the policy at ``version`` (figures as ``Trainer.step``'s)."""
        stats = self._call("step", batch, version)
        self._sync_model()
        return StepResult.of(stats, version)

    def named_masters(self) -> dict[str, torch.Tensor]:
        """The float32 weights the optimizer steps on, full and HF-named (a tied one once)."""
        return self._call("gather_hf")

    def named_grads(self) -> dict[str, torch.Tensor]:
        """The last minibatch's gradients (summed over data-parallel ranks, clipped), full and HF-named."""
        return self._call("gather_hf_grads")

    def state_dict(self) -> dict:
        """Weights, AdamW moments, lr and schedule, keyed by HF names (any parallel layout can resume it)."""
        return self._call("state")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state", state)
        self._sync_model()

    def adopt_moments(self, moments: dict[str, dict[str, torch.Tensor]]) -> int:
        """Start AdamW from earlier moments keyed by HF parameter name (``Trainer.adopt_moments``)."""
        return self._call("adopt_moments", moments)

    def close(self) -> None:
        """Release the followers (their ``follow()`` returns). Idempotent."""
        if self.engine is not None:
            parallel.send_command("stop")
            self.engine = None

    @torch.no_grad()
    def _sync_model(self) -> None:
        weights = self.named_masters()
        for name, p in self.model.named_parameters():
            p.copy_(weights[name])
