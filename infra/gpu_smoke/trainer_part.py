"""Parts (c) and (e): the torch trainer and the megatron-core trainer (tensor parallel 1) on the device.

Throughput: ``train_batch`` trajectories of ``seq_len`` tokens (prompt + answer, 8 answers per prompt
as RL's groups), whole PPO steps (forward, backward, AdamW) timed after a warm-up step; tokens/s =
the batch's tokens / step time.

Equality: one fixed check batch (``check_batch`` x ``check_len`` tokens of the task's own text, the
answers real text the model partly predicts), stepped once by
* the CPU float32 torch trainer (the reference),
* the device's torch trainer in its compute dtype (bfloat16 on a GPU, float32 master weights),
* the megatron trainer on the device (float32).
Every reward is +5 and every behaviour logprob -3 with ``adv_norm: none``, so the first step's loss,
-5 x the mean of exp(logp + 3) over the answer tokens, moves with every logprob the model computes
(the clip is not reached: the proximal policy is the current one). Compared: that loss and the mean
answer-token NLL before the step, each within a relative tolerance: 2e-2 in bfloat16, 1e-4 in float32.
"""

from __future__ import annotations

import copy

import torch

from infra.gpu_smoke.common import Clock, Setup, Skip, fixed_batch, text_batch

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}
GROUP = 8


def trainer_config(s: Setup, check: bool = False):
    """The config's trainer settings, one minibatch, micro-batches of ``microbatch_tokens``; ``check``:
    no advantage normalisation (the check batch's rewards are all +5)."""
    from areal_core.algo.off_policy import OffPolicyNone

    t = s.cfg.trainer
    update = {
        "microbatching": "dynamic",
        "ppo_minibatches": 1,
        "lora": None,
        "objective": "decoupled",
        "off_policy": OffPolicyNone(),
        "max_tokens_per_microbatch": max(s.args.microbatch_tokens, s.args.seq_len, s.args.check_len),
    }
    if check:
        update["adv_norm"] = "none"
    return t.model_copy(update=update)


def check_batch(s: Setup) -> list:
    if "check_batch" not in s.cache:
        s.cache["check_batch"] = text_batch(s.prompts, s.args.check_batch, s.args.check_len, GROUP)
    return s.cache["check_batch"]


def mean_nll(model, batch, autocast: bool) -> float:
    from areal_core.trainer.packed_forward import response_logprobs

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        lp = response_logprobs(model, [t.prompt_ids + t.output_ids for t in batch], [len(t.prompt_ids) for t in batch])
    return float(-lp.float().mean())


def cpu_reference(s: Setup) -> dict:
    """The CPU float32 torch trainer's step on the check batch (cached for part (e))."""
    if "cpu_reference" not in s.cache:
        from areal_core.trainer.trainer import Trainer

        batch = check_batch(s)
        model = copy.deepcopy(s.model32)
        nll = mean_nll(model, batch, autocast=False)
        st = Trainer(model, trainer_config(s, check=True), 1.0, 10).step(batch, 0).metrics
        s.cache["cpu_reference"] = {"loss": st["loss"], "grad_norm": st["grad_norm"], "mean_nll": nll}
    return s.cache["cpu_reference"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(ref: dict, stats: dict, nll: float | None, dtype: torch.dtype) -> dict:
    tol = TOL[dtype]
    out = {
        "loss": stats["loss"],
        "cpu_float32_loss": ref["loss"],
        "loss_rel_diff": _rel(stats["loss"], ref["loss"]),
        "grad_norm": stats["grad_norm"],
        "cpu_float32_grad_norm": ref["grad_norm"],
        "grad_norm_rel_diff": _rel(stats["grad_norm"], ref["grad_norm"]),
        "tolerance": tol,
    }
    ok = out["loss_rel_diff"] <= tol
    if nll is not None:
        out.update(mean_nll=nll, cpu_float32_mean_nll=ref["mean_nll"], nll_rel_diff=_rel(nll, ref["mean_nll"]))
        ok = ok and out["nll_rel_diff"] <= tol
    out["ok"] = ok
    return out


def timed_steps(trainer, batch, steps: int, device: torch.device) -> dict:
    trainer.step(batch, 0)  # warm-up: kernels, allocator, optimizer state
    times = []
    for _ in range(steps):
        with Clock(device) as c:
            st = trainer.step(batch, 0).metrics
        times.append(c.s)
    tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in batch)
    best = min(times)
    return {
        "trajectories": len(batch),
        "tokens_per_step": tokens,
        "trained_tokens_per_step": st["tokens_trained"],
        "step_s": times,
        "tokens_per_s": tokens / best,
        "trained_tokens_per_s": st["tokens_trained"] / best,
        "forward_passes_per_step": st["forward_passes"],
    }


def trainer_part(s: Setup) -> dict:
    from areal_core.trainer.trainer import Trainer

    a = s.args
    ref = cpu_reference(s)
    batch = check_batch(s)
    model = s.device_model()
    autocast = s.device.type == "cuda" and s.dtype == torch.float32
    nll = mean_nll(model, batch, autocast)
    trainer = Trainer(model, trainer_config(s, check=True), 1.0, 10)
    eq = compare(ref, trainer.step(batch, 0).metrics, nll, s.dtype)
    s.cache["device_torch_loss"] = eq["loss"]
    del trainer, model
    big = fixed_batch(s.prompts, a.train_batch, a.seq_len, s.model32.config.vocab_size, GROUP, seed=3)
    trainer = Trainer(s.device_model(), trainer_config(s), 1.0, a.train_steps + 1)
    speed = timed_steps(trainer, big, a.train_steps, s.device)
    out = {
        "device": str(s.device),
        "dtype": str(s.dtype).removeprefix("torch."),
        "master_weights": "float32",
        "microbatch_tokens": trainer_config(s).max_tokens_per_microbatch,
        **speed,
        "equality": eq,
        "ok": eq["ok"],
    }
    if s.device.type == "cuda":
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated(s.device) / 2**30, 2)
    return out


def megatron_part(s: Setup) -> dict:
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        raise Skip("megatron-core is not installed (the `megatron` extra; on the GPU machine its wheel)")
    from areal_core.trainer.megatron import parallel
    from areal_core.trainer.megatron.trainer import MegatronTrainer

    a = s.args
    ref = cpu_reference(s)
    batch = check_batch(s)
    hf = copy.deepcopy(s.model32)  # the published copy stays float32 on the CPU, as run.py keeps it
    trainer = MegatronTrainer(
        hf, trainer_config(s, check=True), 1.0, a.megatron_steps + 2, tp_size=1, device=str(s.device)
    )
    try:
        eq = compare(ref, trainer.step(batch, 0).metrics, None, torch.float32)
        torch_dev = s.cache.get("device_torch_loss")
        big = fixed_batch(s.prompts, a.train_batch, a.seq_len, s.model32.config.vocab_size, GROUP, seed=3)
        speed = timed_steps(trainer, big, a.megatron_steps, s.device) if a.megatron_steps else {}
    finally:
        trainer.close()
        parallel.shutdown()
    return {
        "device": str(s.device),
        "tensor_parallel_size": 1,
        "dtype": "float32",
        **speed,
        "equality": eq,
        "device_torch_trainer_loss": torch_dev,
        "ok": eq["ok"],
    }
