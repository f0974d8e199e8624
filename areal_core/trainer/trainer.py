"""The PPO trainer: blind to where trajectories came from; one call per training step.

step(batch) = advantages -> (proximal logprobs) -> minibatch updates over
micro-batches -> stats. The objective is chosen by config: decoupled PPO
(clip around the proximal policy, importance weight pi_prox / pi_behav) or
naive PPO (clip around the behaviour policy).

Master weights: AdamW always steps on float32 parameters. A model loaded in a lower
precision (``model.dtype: bfloat16``) is the working copy: forward and backward run their
products in that precision (the residual stream between them in float32, as autocast keeps
it: ``packed_forward``), its gradients are summed into
float32 masters, and after each optimizer step the masters are rounded back into it.
So updates smaller than half a bfloat16 step accumulate in the masters instead of being
lost, and what is published (checkpoints, weight pushes) stays in the model's dtype.

LoRA (``trainer.lora``, ``trainer/lora.py``): the model's base parameters are frozen and the
optimizer steps on its float32 adapters only (their own masters).

Device: the model's. On a GPU a float32 model computes its forward and backward under bfloat16
autocast (the weights, and so the masters, stay float32).
"""

from __future__ import annotations

import math
import time

import torch

from areal_core.algo import allocate_shared_prompt_microbatches, split_fixed
from areal_core.models.decoder import check_decoder
from areal_core.trainer.base import StepResult
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.packed_forward import response_logprobs
from areal_core.trainer.step_parts import batch_stats, ppo_loss, prepare_batch, prox_path
from areal_core.types import Trajectory


def lr_lambda(cfg: TrainerConfig, total_steps: int):
    o = cfg.optim

    def f(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.lr_schedule == "constant":
            return 1.0
        frac = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
        return 1.0 - (1.0 - o.min_lr_ratio) * frac

    return f


class Trainer:
    def __init__(self, model, cfg: TrainerConfig, temperature: float, total_steps: int):
        check_decoder(model, training=True)
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.autocast = self.device.type == "cuda" and next(model.parameters()).dtype == torch.float32
        # the trainable parameters, a tied one once: all of them, or only the adapters of a LoRA
        # model (trainer/lora.py), whose base is frozen; so the optimizer state is theirs alone
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameter")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # float32 parameters are their own masters; others get a float32 copy
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_(p.requires_grad) for p in self._params
        ]
        self._low = [(p, m) for p, m in zip(self._params, self.masters) if p is not m]
        o = cfg.optim
        # fused: one kernel per parameter, faster than the per-tensor loop torch picks on CPU, and like it
        # the same bits on every thread count and vector width
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.last_plan: dict | None = None  # the last step's minibatches and micro-batches (indices into its batch)

    def named_masters(self) -> dict[str, torch.Tensor]:
        """The float32 weights the optimizer steps on, by parameter name."""
        return dict(zip(self._names, self.masters))

    def state_dict(self) -> dict:
        """Optimizer and lr-scheduler state, and the float32 masters of a lower-precision model
        (the published checkpoint holds only their rounding). Its tensors are the live ones, as in
        torch's ``state_dict``: the next step changes them (``run_state.encode`` keeps a copy)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self._low:
            state["master_weights"] = {n: m.detach() for n, m in self.named_masters().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state. Masters missing from it are taken from the model."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        saved = state.get("master_weights", {})
        with torch.no_grad():
            for name, p, m in zip(self._names, self._params, self.masters):
                if p is not m:
                    m.copy_(saved.get(name, p))
                    p.copy_(m)

    def _accumulate_grads(self) -> None:
        """Add the working copy's gradients into the float32 masters' (and free them)."""
        for p, m in self._low:
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def _round_into_model(self) -> None:
        for p, m in self._low:
            p.copy_(m)

    def adopt_moments(self, moments: dict[str, dict[str, torch.Tensor]]) -> int:
        """Start AdamW from earlier moments (e.g. the warm start's), keyed by parameter name.

        A fresh AdamW's first updates are about ``lr`` per parameter whatever the
        gradient's size (the moments are still near zero), which knocks a small
        warm-started model off its optimum; continuing its moments avoids that.
        The hyperparameters (lr, betas, weight decay) stay this trainer's own.
        Returns the number of parameters whose state was adopted.
        """
        n = 0
        for name, p in self.named_masters().items():
            st = moments.get(name)
            if st is None:
                continue
            if st["exp_avg"].shape != p.shape:
                raise ValueError(
                    f"moments for {name} have shape {tuple(st['exp_avg'].shape)}, the parameter has {tuple(p.shape)}"
                )
            self.optimizer.state[p] = {k: v.clone() for k, v in st.items()}
            n += 1
        return n

    def microbatches(self, prompts: list[list[int]], answer_lens: list[int]) -> list[list[int]]:
        """Micro-batches of one minibatch (indices into it); dynamic packing counts a shared prompt once,
        as the packed forward computes it."""
        if self.cfg.microbatching == "dynamic":
            return allocate_shared_prompt_microbatches(prompts, answer_lens, self.cfg.max_tokens_per_microbatch)
        return split_fixed(len(prompts), min(self.cfg.n_microbatches, len(prompts)))

    def _logprobs(self, seqs, starts, idx) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            lp = response_logprobs(self.model, [seqs[i] for i in idx], [starts[i] for i in idx], self.temperature)
        return lp.float()

    def prox_path(self, n_minibatches: int) -> str:
        return prox_path(self.cfg, n_minibatches)

    def _recompute_prox(self, seqs, starts, n_out) -> tuple[list[torch.Tensor], int]:
        """pi_prox logprobs of every trajectory by the weights before this step (no-grad forward
        passes), and the number of passes."""
        prox: list[torch.Tensor] = [None] * len(seqs)
        groups = self.microbatches([s[:st] for s, st in zip(seqs, starts)], n_out)
        with torch.no_grad():
            for mb in groups:
                for i, lp in zip(mb, self._logprobs(seqs, starts, mb).split([n_out[i] for i in mb])):
                    prox[i] = lp
        return prox, len(groups)

    def step(self, batch: list[Trajectory], version: int) -> StepResult:
        """One training step on ``batch`` by the policy at ``version``."""
        t0 = time.perf_counter()
        cfg = self.cfg
        prep = prepare_batch(batch, cfg.adv_norm)
        seqs, starts, n_out = prep.seqs, prep.starts, prep.n_out

        minibatches = split_fixed(len(batch), cfg.ppo_minibatches)
        path = self.prox_path(len(minibatches))
        prox, n_prox_forward = self._recompute_prox(seqs, starts, n_out) if path == "recompute" else (None, 0)
        versions = [torch.tensor(t.output_versions) for t in batch] if path == "loglinear" else None

        self.model.train()
        sums: dict[str, float] = {}
        n_forward = 0
        grad_norms = []
        self.last_plan = {"minibatches": [list(m) for m in minibatches], "microbatches": []}
        for mbatch in minibatches:
            n_tokens = sum(prep.n_trained[i] for i in mbatch)
            self.optimizer.zero_grad(set_to_none=True)
            for local in self.microbatches([batch[i].prompt_ids for i in mbatch], [n_out[i] for i in mbatch]):
                idx = [mbatch[j] for j in local]
                self.last_plan["microbatches"].append(idx)
                logp = self._logprobs(seqs, starts, idx)
                loss, st = ppo_loss(
                    cfg, path, logp, prep, idx, prox=prox, versions=versions, version=version, n_tokens=n_tokens
                )
                loss.backward()
                self._accumulate_grads()
                n_forward += 1
                share = sum(prep.n_trained[i] for i in idx) / sum(prep.n_trained)
                sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * n_tokens / sum(prep.n_trained)
                for k, v in st.items():
                    if k.endswith("_max"):
                        sums[k] = max(sums.get(k, -math.inf), v)
                    elif k.endswith("_sum"):
                        sums[k] = sums.get(k, 0.0) + v
                    else:
                        sums[k] = sums.get(k, 0.0) + v * share
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.masters, cfg.optim.grad_clip)))
            self.optimizer.step()
            self._round_into_model()
        if sums.get("logprob_gap_tokens_sum"):  # engine vs trainer at the behaviour version (step_parts.logprob_gap)
            sums["logprob_gap_mean"] = sums["logprob_gap_sum"] / sums["logprob_gap_tokens_sum"]
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return StepResult.of(
            {
                **sums,
                **batch_stats(batch, prep, version),
                "forward_passes": n_forward,
                "prox_logp_path": path,
                "prox_forward_passes": n_prox_forward,
                "grad_norm": max(grad_norms),
                "lr": lr,
                "train_time_s": time.perf_counter() - t0,
            },
            version,
        )
