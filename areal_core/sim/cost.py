"""The cost model: how long a decode step, a prefill, a training step and a weight
update take, and how many KV tokens a rollout server holds.

`CostModel` holds the coefficients the simulator uses and nothing else, so the same
simulator runs on roofline-derived figures (`build_cost_model`, from a `GPUSpec`, a
`ModelSpec` and an `Efficiency`) or on figures fitted to measurements
(`areal_core.sim.calibrate.calibrate_from`); `in_situ_cost` scales one by what runs of the
whole system measured it to add (`areal_core.sim.in_situ`).

Roofline, per rollout server (a tensor-parallel group of `tp` devices) and per decode
step over a batch of `b` sequences holding `C` context tokens in total:

    step = overhead + max(memory, compute)
    memory  = weights / tp / (bw * bw_eff) + C * kv_bytes_per_token / tp / (bw * bw_eff)
    compute = b * 2 * params / (tp * peak * mfu) + C * 4 * layers * heads * head_dim / (tp * peak * mfu)

Small batches are memory-bound (the weights are read once per step, whatever `b`);
large batches of short sequences are compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from areal_core.sim.hardware import GPUSpec, ModelSpec

TRAIN_PASSES = 4
"""Forward-pass equivalents per trained token: forward + backward (2x) + the no-grad
forward that recomputes the logprobs of the weights before the step."""

TRAIN_STATE_BYTES_PER_PARAM = 16
"""Mixed-precision AdamW: bf16 weights (2) + bf16 grads (2) + fp32 master (4) + fp32
Adam moments (8); the 16 bytes/parameter of the ZeRO paper, sharded over the trainer."""


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the datasheet a real system gets, and fixed overheads.

    These are the model's assumptions, one value for every setting (none is fitted to a
    row of the validation table); docs/PLANNING.md discusses them.

    Attributes:
        decode_bw_eff: achieved fraction of HBM bandwidth in a decode step.
        decode_mfu: achieved fraction of peak FLOP/s in the compute part of a decode step.
        prefill_mfu: achieved fraction of peak FLOP/s in a prefill.
        train_mfu: achieved fraction of peak FLOP/s in a training step (one device).
        decode_step_overhead_s: fixed time per decode step (scheduler, sampling, launches).
        tp_allreduce_s: latency of one tensor-parallel all-reduce (two per layer per step).
        train_scaling_eff: strong-scaling efficiency per doubling of trainer devices.
        train_step_overhead_s: fixed time per training step (optimizer step, batching).
        weight_update_bandwidth: bytes/s at which a server device loads its weight shard.
        weight_update_latency_s: fixed part of one weight update (pause, sync, resume).
        rollout_mem_fraction: share of device memory a server uses for weights + KV.
        trainer_mem_fraction: share of device memory the training state may use.
        host_bandwidth: bytes/s between device and host (synchronous RL offloads the
            training state while the devices generate, and loads it back).
    """

    decode_bw_eff: float = 0.7
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.5
    train_mfu: float = 0.4
    decode_step_overhead_s: float = 0.003
    tp_allreduce_s: float = 10e-6
    train_scaling_eff: float = 0.97
    train_step_overhead_s: float = 1.0
    weight_update_bandwidth: float = 10e9
    weight_update_latency_s: float = 1.0
    rollout_mem_fraction: float = 0.8
    trainer_mem_fraction: float = 0.9
    host_bandwidth: float = 25e9


@dataclass(frozen=True)
class CostModel:
    """Time coefficients of one rollout server and of the trainer (seconds).

    Attributes:
        decode_overhead_s: fixed time of a decode step.
        decode_weight_read_s: memory time of a step that does not depend on the batch
            (reading the weights).
        decode_kv_read_s_per_token: memory time per context token in the batch.
        decode_flop_s_per_seq: compute time per sequence in the batch (dense layers).
        decode_flop_s_per_ctx_token: compute time per context token (attention).
        prefill_overhead_s: fixed time of a prefill.
        prefill_s_per_token: dense compute time per prefilled token.
        prefill_s_per_token_sq: attention time per squared sequence length (causal),
            summed over the prefilled sequences.
        kv_capacity_tokens: KV tokens one server holds.
        train_device_s_per_token: device-seconds per trained token (dense part).
        train_device_s_per_token_sq: device-seconds per squared sequence length.
        train_step_overhead_s: fixed time of a training step.
        train_scaling_eff: strong-scaling efficiency per doubling of trainer devices.
        weight_update_s: pause -> load -> resume, per update, on a server.
        colocate_switch_s: synchronous RL only: moving the training state off and back
            onto the devices around each generation phase.
    """

    decode_overhead_s: float
    decode_weight_read_s: float
    decode_kv_read_s_per_token: float
    decode_flop_s_per_seq: float
    decode_flop_s_per_ctx_token: float
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_sq: float
    kv_capacity_tokens: int
    train_device_s_per_token: float
    train_device_s_per_token_sq: float
    train_step_overhead_s: float
    train_scaling_eff: float
    weight_update_s: float
    colocate_switch_s: float = 0.0

    def with_(self, **changes) -> CostModel:
        return replace(self, **changes)

    # ---- rollout server -------------------------------------------------------------
    def decode_step_s(self, batch: int, ctx_tokens: float) -> float:
        memory = self.decode_weight_read_s + self.decode_kv_read_s_per_token * ctx_tokens
        compute = self.decode_flop_s_per_seq * batch + self.decode_flop_s_per_ctx_token * ctx_tokens
        return self.decode_overhead_s + max(memory, compute)

    def decode_span_s(self, batch: int, ctx0: float, steps: int) -> float:
        """Time of `steps` decode steps of a fixed batch whose context starts at `ctx0`
        tokens and grows by `batch` tokens a step (closed form)."""
        if steps <= 0:
            return 0.0
        m0 = self.decode_weight_read_s + self.decode_kv_read_s_per_token * ctx0
        m1 = self.decode_kv_read_s_per_token * batch
        k0 = self.decode_flop_s_per_seq * batch + self.decode_flop_s_per_ctx_token * ctx0
        k1 = self.decode_flop_s_per_ctx_token * batch
        # memory wins from step `split` on (or up to it, when it grows slower)
        if m1 == k1:
            split = 0 if m0 >= k0 else steps
            mem_first = False
        else:
            crossing = (k0 - m0) / (m1 - k1)
            split = min(max(math.ceil(crossing), 0), steps)
            mem_first = m1 < k1
        if mem_first:
            total = _arith(m0, m1, 0, split) + _arith(k0, k1, split, steps)
        else:
            total = _arith(k0, k1, 0, split) + _arith(m0, m1, split, steps)
        return total + self.decode_overhead_s * steps

    def steps_to_reach(self, batch: int, ctx0: float, dt: float, max_steps: int) -> int:
        """Fewest steps (<= max_steps) whose span is at least `dt`: the step boundary
        at or after `dt` seconds from now."""
        if dt <= 0:
            return 0
        if self.decode_span_s(batch, ctx0, max_steps) <= dt:
            return max_steps
        lo, hi = 0, max_steps  # span(lo) < dt <= span(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_span_s(batch, ctx0, mid) >= dt:
                hi = mid
            else:
                lo = mid
        return hi

    def prefill_s(self, tokens: float, tokens_sq: float) -> float:
        """Prefill of sequences with `tokens` tokens in all and `tokens_sq` = sum of
        their squared lengths (attention is quadratic)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + self.prefill_s_per_token * tokens + self.prefill_s_per_token_sq * tokens_sq

    # ---- trainer --------------------------------------------------------------------
    def scaling_efficiency(self, n_devices: int) -> float:
        return self.train_scaling_eff ** math.log2(max(n_devices, 1))

    def train_s(self, tokens: float, tokens_sq: float, n_devices: int) -> float:
        """One training step over `tokens` trained tokens (sequences' squared lengths
        summing to `tokens_sq`) on `n_devices` devices."""
        device_s = self.train_device_s_per_token * tokens + self.train_device_s_per_token_sq * tokens_sq
        return self.train_step_overhead_s + device_s / (n_devices * self.scaling_efficiency(n_devices))


def _arith(a: float, b: float, lo: int, hi: int) -> float:
    """sum_{j=lo}^{hi-1} (a + b j)."""
    n = hi - lo
    if n <= 0:
        return 0.0
    return n * a + b * n * (lo + hi - 1) / 2


def rollout_memory_need(model: ModelSpec, seq_tokens: int) -> float:
    """Bytes one server needs at least: the weights plus the KV of one full sequence."""
    return model.weight_bytes + model.kv_bytes_per_token * seq_tokens


def check_rollout_fits(
    model: ModelSpec, gpu: GPUSpec, tp: int, seq_tokens: int, eff: Efficiency, field: str = "rollout_tp"
) -> None:
    have = tp * gpu.memory_bytes * eff.rollout_mem_fraction
    need = rollout_memory_need(model, seq_tokens)
    if need > have:
        raise ValueError(
            f"{field}: model {model.name} does not fit a rollout server of {tp} x {gpu.name}: "
            f"weights {model.weight_bytes / 1e9:.1f} GB + KV of one {seq_tokens}-token sequence "
            f"{model.kv_bytes_per_token * seq_tokens / 1e9:.1f} GB = {need / 1e9:.1f} GB > "
            f"{have / 1e9:.1f} GB usable ({eff.rollout_mem_fraction:.0%} of {tp} x {gpu.memory_bytes / 1e9:.0f} GB); "
            f"use more devices per server"
        )


def check_trainer_fits(
    model: ModelSpec, gpu: GPUSpec, n_devices: int, eff: Efficiency, field: str = "n_trainer_gpus"
) -> None:
    have = n_devices * gpu.memory_bytes * eff.trainer_mem_fraction
    need = TRAIN_STATE_BYTES_PER_PARAM * model.params
    if need > have:
        raise ValueError(
            f"{field}: model {model.name} does not fit {n_devices} x {gpu.name} for training: weights + grads + "
            f"optimizer state {need / 1e9:.0f} GB ({TRAIN_STATE_BYTES_PER_PARAM} bytes/param) > {have / 1e9:.0f} GB "
            f"usable ({eff.trainer_mem_fraction:.0%} of device memory)"
        )


def smallest_rollout_tp(model: ModelSpec, gpu: GPUSpec, seq_tokens: int, eff: Efficiency, max_tp: int = 8) -> int:
    """The smallest power-of-two tensor-parallel width whose server holds the weights and
    one full sequence."""
    tp = 1
    while tp <= max_tp:
        if rollout_memory_need(model, seq_tokens) <= tp * gpu.memory_bytes * eff.rollout_mem_fraction:
            return tp
        tp *= 2
    check_rollout_fits(model, gpu, max_tp, seq_tokens, eff, field="model")
    return max_tp  # unreachable: the check raised


def build_cost_model(
    model: ModelSpec, gpu: GPUSpec, tp: int, eff: Efficiency = Efficiency(), train_devices_for_switch: int = 0
) -> CostModel:
    """Roofline coefficients for a server of `tp` x `gpu` serving `model`, and for the
    trainer on `gpu`. `train_devices_for_switch` > 0 sets the synchronous-RL switch cost
    (the training state of that many devices moved to the host and back)."""
    bw = gpu.hbm_bandwidth * eff.decode_bw_eff
    decode_flops = tp * gpu.peak_flops * eff.decode_mfu
    prefill_flops = tp * gpu.peak_flops * eff.prefill_mfu
    train_flops = gpu.peak_flops * eff.train_mfu
    weight_read = model.weight_bytes / tp / bw
    overhead = eff.decode_step_overhead_s + (2 * model.layers * eff.tp_allreduce_s if tp > 1 else 0.0)
    kv_capacity = (tp * gpu.memory_bytes * eff.rollout_mem_fraction - model.weight_bytes) / model.kv_bytes_per_token
    switch = 0.0
    if train_devices_for_switch > 0:
        state_per_device = TRAIN_STATE_BYTES_PER_PARAM * model.params / train_devices_for_switch
        switch = 2 * state_per_device / eff.host_bandwidth
    return CostModel(
        decode_overhead_s=overhead,
        decode_weight_read_s=weight_read,
        decode_kv_read_s_per_token=model.kv_bytes_per_token / tp / bw,
        decode_flop_s_per_seq=2 * model.params / decode_flops,
        decode_flop_s_per_ctx_token=model.attn_flops_per_token_pair / decode_flops,
        prefill_overhead_s=overhead + weight_read,
        prefill_s_per_token=2 * model.params / prefill_flops,
        prefill_s_per_token_sq=model.attn_flops_per_token_pair / 2 / prefill_flops,
        kv_capacity_tokens=max(int(kv_capacity), 0),
        train_device_s_per_token=TRAIN_PASSES * 2 * model.params / train_flops,
        train_device_s_per_token_sq=TRAIN_PASSES * model.attn_flops_per_token_pair / 2 / train_flops,
        train_step_overhead_s=eff.train_step_overhead_s,
        train_scaling_eff=eff.train_scaling_eff,
        weight_update_s=eff.weight_update_latency_s + model.weight_bytes / tp / eff.weight_update_bandwidth,
        colocate_switch_s=switch,
    )


# What an in-situ fit (areal_core.sim.in_situ) gives per mode
FIT_KEYS = ("train_slowdown", "train_fixed_s", "step_overhead_s", "generation_slowdown", "generation_fixed_s")


def in_situ_cost(cost: CostModel, in_situ: dict | None, mode: str) -> CostModel:
    """`cost` with the in-situ fit of `mode` applied (unchanged without a fit at all)."""
    if not in_situ or not in_situ.get("modes"):
        return cost
    if mode not in in_situ["modes"]:
        raise ValueError(f"in-situ calibration has no {mode!r} runs (has: {sorted(in_situ['modes'])})")
    f = in_situ["modes"][mode]
    missing = [k for k in FIT_KEYS if k not in f]
    if missing:
        raise ValueError(
            f"in-situ calibration for {mode!r} lacks {missing}: fit it again (areal-flow calibrate-in-situ)"
        )
    g, k = f["generation_slowdown"], f["train_slowdown"]
    if g <= 0 or k <= 0 or f["step_overhead_s"] < 0 or f["generation_fixed_s"] < 0:
        raise ValueError(
            f"in-situ calibration for {mode!r}: slowdowns must be > 0 and the step overhead and "
            f"fixed generation time >= 0, got {f}"
        )
    fixed = cost.train_step_overhead_s * k + f["train_fixed_s"] + f["step_overhead_s"]
    if fixed < 0:
        raise ValueError(
            f"in-situ calibration for {mode!r}: a training step's fixed time comes out at "
            f"{fixed * 1e3:.1f} ms (< 0): the calibration runs do not constrain it; measure again"
        )
    generation = {
        name: getattr(cost, name) * g
        for name in (
            "decode_overhead_s",
            "decode_weight_read_s",
            "decode_kv_read_s_per_token",
            "decode_flop_s_per_seq",
            "decode_flop_s_per_ctx_token",
            "prefill_overhead_s",
            "prefill_s_per_token",
            "prefill_s_per_token_sq",
        )
    }
    # a synchronous step's fixed wait sits where it falls, between the training and the next generation
    return cost.with_(
        **generation,
        train_device_s_per_token=cost.train_device_s_per_token * k,
        train_device_s_per_token_sq=cost.train_device_s_per_token_sq * k,
        train_step_overhead_s=fixed,
        weight_update_s=cost.weight_update_s + f["generation_fixed_s"],
    )
