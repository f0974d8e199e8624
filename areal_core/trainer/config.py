from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from areal_core.algo.off_policy import OffPolicyConfig, OffPolicyNone
from areal_core.configbase import Section


class OptimConfig(Section):
    """AdamW and its learning-rate schedule, stepped once per training step (either trainer backend)."""

    lr: float = Field(2e-5, gt=0)  # the peak learning rate (after warmup)
    # after warmup: constant, or linear from lr towards lr * min_lr_ratio, reached as the run's steps end
    lr_schedule: Literal["constant", "linear"] = "linear"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # lr_schedule linear: the lr at the run's end as a share of lr
    warmup_steps: int = Field(0, ge=0)  # steps whose lr rises linearly from lr / warmup_steps to lr; 0: none
    weight_decay: float = Field(0.05, ge=0)  # AdamW's decoupled weight decay
    beta1: float = Field(0.9, ge=0, lt=1)  # AdamW's decay rate of the gradient's running mean
    beta2: float = Field(0.95, ge=0, lt=1)  # AdamW's decay rate of the squared gradient's running mean
    eps: float = Field(1e-5, gt=0)  # AdamW's epsilon, added to the denominator
    grad_clip: float = Field(1.0, gt=0)  # the gradient's global L2 norm is clipped to this at every optimizer step
    # start AdamW from the tiny model's warm-start moments instead of zeros (see Trainer.adopt_moments)
    continue_warm_start: bool = False


class TorchTrainerBackend(Section):
    """The torch trainer (areal_core/trainer/trainer.py): one process, packed shared-prompt forward."""

    kind: Literal["torch"] = "torch"


class MegatronTrainerBackend(Section):
    """A megatron-core GPTModel (areal_core/trainer/megatron/, the ``megatron`` extra) over
    ``processes`` gloo ranks: tensor parallel ``tensor_parallel_size``, data parallel the rest.
    The run starts ranks 1.. on this host itself; under ``torchrun`` it uses torchrun's."""

    kind: Literal["megatron"] = "megatron"
    tensor_parallel_size: int = Field(1, gt=0)  # ranks each layer's weights are split over; divides processes
    processes: int = Field(1, gt=0)  # gloo ranks in all (data parallel: processes / tensor_parallel_size)

    @model_validator(mode="after")
    def _tp_divides(self):
        if self.processes % self.tensor_parallel_size:
            raise ValueError(
                f"trainer.backend.tensor_parallel_size ({self.tensor_parallel_size}) must divide "
                f"trainer.backend.processes ({self.processes})"
            )
        return self


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """Low-rank adapters (areal_core/trainer/lora.py): only they train and travel to the servers;
    every base weight stays frozen at checkpoint v0."""

    rank: int = Field(16, gt=0)  # r: lora_A is [r, in_features], lora_B [out_features, r]
    alpha: float = Field(32.0, gt=0)  # the adapters' output is scaled by alpha / rank
    # the nn.Linear modules (by their last name part) of every decoder layer that get adapters
    targets: list[LoraTarget] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)

    @model_validator(mode="after")
    def _unique_targets(self):
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"trainer.lora.targets: each target once, got {self.targets}")
        return self


class TrainerConfig(Section):
    """The RL trainer: its backend, batch, staleness, objective, rewards, micro-batching and optimizer."""

    # {kind: torch} (shorthand `backend: torch`) or {kind: megatron, tensor_parallel_size, processes}
    backend: Annotated[TorchTrainerBackend | MegatronTrainerBackend, Field(discriminator="kind")] = (
        TorchTrainerBackend()
    )
    batch_size: int = Field(128, gt=0)  # B: trajectories per training step
    eta: int = Field(4, ge=0)  # max staleness; 0 = synchronous
    max_steps: int = Field(100, gt=0)  # training steps of the run (the lr schedule's length); --max-steps overrides
    # decoupled: AReaL's PPO with a proximal policy between behaviour and current (areal_core/algo/losses.py);
    # naive: plain PPO clipped against the behaviour policy
    objective: Literal["decoupled", "naive"] = "decoupled"
    eps_clip: float = Field(0.2, gt=0, lt=1)  # PPO's clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip]
    # what replaces the decoupled objective's behaviour weight w = pi_prox / pi_behav
    # (areal_core/algo/off_policy.py, docs/RL_TUNING.md): {kind: none | cap | tis | mis | geo_mask |
    # icepop | m2po, and the kind's settings}; shorthand `off_policy: icepop` (the kind's defaults)
    off_policy: OffPolicyConfig = OffPolicyNone()
    reward_correct: float = 5.0  # a right answer's reward
    reward_wrong: float = -5.0  # a wrong answer's reward (partial credit lands between the two)
    # advantage = the reward minus the mean, over the std: of the whole batch, of the answers to the same
    # prompt (group, GRPO-style), or the reward as it is (none)
    adv_norm: Literal["batch", "group", "none"] = "batch"
    ppo_minibatches: int = Field(1, gt=0)  # optimizer steps per training step, each on an equal share of the batch
    # pi_prox for decoupled PPO with ppo_minibatches > 1 (with one minibatch it is the update's own
    # forward, exact and free): "recompute" = a no-grad forward pass over the batch before the
    # update; "loglinear" = AReaL's interpolation between behaviour and current logprobs by version
    # (no extra forward; areal_core/algo/prox.py)
    prox_logp: Literal["recompute", "loglinear"] = "recompute"
    # how a minibatch is split for the forward and backward passes: dynamic = packed up to
    # max_tokens_per_microbatch tokens each; fixed = n_microbatches shares of (nearly) equal size
    microbatching: Literal["dynamic", "fixed"] = "dynamic"
    max_tokens_per_microbatch: int = Field(4096, gt=0)  # dynamic
    n_microbatches: int = Field(4, gt=0)  # fixed
    warmup_steps_for_throughput: int = Field(2, ge=0)  # excluded from effective throughput
    optim: OptimConfig = OptimConfig()
    # None: all cores when generation is idle while the trainer works (eta 0 + rollout.weight_update
    # drain), else the cores the rollout servers leave (measured best: docs/PERFORMANCE.md)
    torch_threads: int | None = Field(None, gt=0)
    # with torch_threads unset, embedded servers on this machine and a split of the cores: the trainer
    # also computes on the servers' cores while no generate request is in flight (trainer/core_lending.py).
    # None (the default): on where the trainer's arithmetic does not depend on its thread count
    # (areal_core/numerics.py thread_invariant: float32 on an Intel CPU, bfloat16 on a CPU without
    # AVX-512), so that runs still repeat; true: on everywhere (a run may then not repeat bit for bit)
    lend_idle_cores: bool | None = None
    # with lending on: the trainer borrows in a step only if the servers were idle in at least this
    # share of its layer passes (forward and backward) of the step before; where they are idle only in
    # short gaps between requests, a borrowed thread collides with them (0: borrow at every idle moment);
    # while admission waits at the staleness gate with no request in flight it borrows regardless
    lend_min_idle_share: float = Field(0.5, ge=0.0, le=1.0)
    # low-rank adapters {rank, alpha, targets}: only they train and travel; None = full fine-tuning
    lora: LoraConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data):
        if not isinstance(data, dict):
            return data
        if "behav_weight_cap" in data:
            cap = data["behav_weight_cap"]
            if cap is not None:
                raise ValueError(
                    f"trainer.behav_weight_cap was replaced by trainer.off_policy: write "
                    f"`off_policy: {{kind: cap, cap: {cap}}}` (or --set trainer.off_policy.kind=cap "
                    f"--set trainer.off_policy.cap={cap})"
                )
            # null, as the saved configs of earlier runs hold it, is the default: no correction
            data = {k: v for k, v in data.items() if k != "behav_weight_cap"}
        for key in ("backend", "off_policy"):
            if isinstance(data.get(key), str):
                data = {**data, key: {"kind": data[key]}}
        return data

    @model_validator(mode="after")
    def _prox_needs_decoupled(self):
        if self.prox_logp != "recompute" and self.objective != "decoupled":
            raise ValueError(
                f"trainer.prox_logp = {self.prox_logp!r} needs trainer.objective = 'decoupled' "
                f"(the {self.objective!r} objective has no proximal policy)"
            )
        return self

    @model_validator(mode="after")
    def _off_policy_needs_decoupled(self):
        if self.off_policy.kind != "none" and self.objective != "decoupled":
            raise ValueError(
                f"trainer.off_policy.kind = {self.off_policy.kind!r} needs trainer.objective = "
                f"'decoupled' (the {self.objective!r} objective has no behaviour weight to correct)"
            )
        return self
