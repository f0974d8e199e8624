"""The megatron trainer's per-rank work. Every method is collective: all ranks call it, in the same order.

A step mirrors ``areal_core.trainer.trainer.Trainer.step`` (same advantages, same pi_prox paths, the
same loss functions and the same minibatch token-count normalisation, so micro-batch losses add up
to the minibatch's); what differs is where the tokens go:

- data parallelism: each minibatch's trajectories are dealt to the data-parallel ranks by tokens
  (longest first, to the least-loaded rank); each rank packs its share into micro-batches with
  ``allocate_microbatches`` (the full length of every sequence: this forward does not share prompts)
  or ``split_fixed``; the gradients are summed over the ranks before clipping
  (``shims.finalize_model_grads``);
- tensor parallelism: every rank of a tensor-parallel group computes the same micro-batches on its
  shard; megatron's layers do the communication; the gradient norm sums the shards' squares;
- a micro-batch is right-padded to its longest sequence ([B, S] through ``GPTModel``, causal mask);
  the logits stay vocab-parallel and log p(token) comes from megatron's vocab-parallel cross entropy.

Optimizer: a plain ``torch.optim.AdamW`` over the megatron module's float32 parameters (megatron's
own optimizer and schedules hard-code CUDA), with the torch trainer's hyperparameters and schedule.
"""

from __future__ import annotations

import math
import time

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from areal_core.algo import allocate_microbatches, split_fixed
from areal_core.algo.losses import STAT_KEYS
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.megatron import mapping, parallel, shims
from areal_core.trainer.step_parts import batch_stats, ppo_loss, prepare_batch, prox_path
from areal_core.trainer.trainer import lr_lambda
from areal_core.types import Trajectory


def deal_by_tokens(indices: list[int], lengths: list[int], n_ranks: int) -> list[list[int]]:
    """Split ``indices`` over ``n_ranks`` by tokens: longest first, each to the least-loaded rank
    (the lowest on ties). Deterministic, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    load = [0] * n_ranks
    for i in sorted(indices, key=lambda i: -lengths[i]):
        r = min(range(n_ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


class MegatronEngine:
    def __init__(
        self,
        hf_config,
        cfg: TrainerConfig,
        temperature: float,
        total_steps: int,
        tp: int,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.device, backend = parallel.use_device(device)  # NCCL between GPUs, gloo between CPU processes
        cuda = self.device.type == "cuda"
        self.layout = lay = parallel.init_parallel(tp, backend=backend)
        self.arch = mapping.arch_of(hf_config, tp)
        self.cfg, self.temperature = cfg, temperature
        self.module = mapping.build_gpt(self.arch, tp, cpu=not cuda)  # on CUDA: on this rank's GPU
        if cuda:  # megatron's own CUDA RNG tracker and scratch buffer (a CPU engine before may have shimmed them)
            shims.use_cuda_defaults(seed)
        else:
            shims.apply_cpu_shims(self.module, seed, lay.tp_rank)
        local = self.arch.padded_vocab(tp) // tp
        cols = torch.arange(lay.tp_rank * local, (lay.tp_rank + 1) * local, device=self.device)
        self._padded_cols = cols >= self.arch.vocab if bool((cols >= self.arch.vocab).any()) else None
        self._names = [n for n, _ in self.module.named_parameters()]
        self._params = [p for _, p in self.module.named_parameters()]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(  # fused, as the torch trainer's
            self._params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))

    # ---- weights and state ------------------------------------------------------------------

    def load_hf(self, hf: dict[str, torch.Tensor] | None = None) -> None:
        """Rank 0's full HF tensors (others: None) into every rank's shard."""
        full = parallel.broadcast_tensors(hf, mapping.hf_shapes(self.arch))
        mapping.load_into(self.module, mapping.hf_to_megatron(full, self.arch, self.layout.tp, self.layout.tp_rank))

    def _to_hf(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Megatron-named local shards -> full HF tensors on rank 0 (None elsewhere)."""
        if self.layout.dp_rank != 0:
            return None
        shards = parallel.gather_tp(local, self.layout)
        return mapping.megatron_to_hf(shards, self.arch) if self.layout.rank == 0 else None

    def gather_hf(self) -> dict[str, torch.Tensor] | None:
        return self._to_hf({n: p.detach() for n, p in zip(self._names, self._params)})

    def gather_hf_grads(self) -> dict[str, torch.Tensor] | None:
        """The last minibatch's gradients (after the all-reduce and clipping), like :meth:`gather_hf`."""
        return self._to_hf(
            {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in zip(self._names, self._params)}
        )

    def state(self) -> dict | None:
        """Everything a resume needs, keyed by HF names (independent of the parallel layout); rank 0."""
        weights = self.gather_hf()
        moments = None
        if self.optimizer.state:  # after the first step
            states = [self.optimizer.state[p] for p in self._params]
            avg = self._to_hf({n: st["exp_avg"] for n, st in zip(self._names, states)})
            sq = self._to_hf({n: st["exp_avg_sq"] for n, st in zip(self._names, states)})
            if avg is not None:
                step = states[0]["step"]
                moments = {n: {"step": step.clone(), "exp_avg": avg[n], "exp_avg_sq": sq[n]} for n in avg}
        if self.layout.rank != 0:
            return None
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {
            "backend": "megatron",
            "master_weights": weights,
            "moments": moments,
            "param_groups": groups,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state(self, state: dict) -> None:
        if state.get("backend") != "megatron":
            raise ValueError(
                f"not a megatron trainer state (backend {state.get('backend')!r}); "
                "the torch trainer's optimizer state is keyed by its own parameter order"
            )
        self.load_hf(state["master_weights"])
        self.optimizer.state.clear()
        if state["moments"] is not None:
            self.adopt_moments(state["moments"])
        for g, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update(saved)
        self.scheduler.load_state_dict(state["scheduler"])

    def adopt_moments(self, moments: dict[str, dict[str, torch.Tensor]]) -> int:
        """AdamW state keyed by HF names (every parameter's; ``Trainer.adopt_moments``' format)."""
        shapes = mapping.hf_shapes(self.arch)
        missing = [n for n in shapes if n not in moments]
        if missing:
            raise KeyError(
                f"moments lack {len(missing)} parameters, e.g. {missing[:3]} (the megatron trainer "
                "fuses q/k/v and gate/up, so it adopts all or nothing)"
            )
        for n, s in shapes.items():
            if tuple(moments[n]["exp_avg"].shape) != s:
                raise ValueError(f"moments for {n} have shape {tuple(moments[n]['exp_avg'].shape)}, the parameter {s}")
        tp, r = self.layout.tp, self.layout.tp_rank
        avg = mapping.hf_to_megatron({n: m["exp_avg"] for n, m in moments.items()}, self.arch, tp, r)
        sq = mapping.hf_to_megatron({n: m["exp_avg_sq"] for n, m in moments.items()}, self.arch, tp, r)
        step = next(iter(moments.values()))["step"]
        for n, p in zip(self._names, self._params):
            self.optimizer.state[p] = {
                "step": torch.as_tensor(step, dtype=torch.float32).cpu().clone(),
                "exp_avg": avg[n].to(p.device, copy=True),
                "exp_avg_sq": sq[n].to(p.device, copy=True),
            }
        return len(shapes)

    # ---- forward ----------------------------------------------------------------------------

    def logprobs(self, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
        """``response_logprobs``' result (flattened, in order) from megatron's forward on a padded batch."""
        if not seqs:
            raise ValueError("empty micro-batch")
        S = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), S, dtype=torch.long)  # built on the CPU, moved once
        rows, cols, targets = [], [], []
        for r, (s, st) in enumerate(zip(seqs, starts)):
            if not 1 <= st < len(s):
                raise ValueError(f"sequence {r}: response start {st} must lie in [1, {len(s) - 1}]")
            ids[r, : len(s)] = torch.tensor(s)
            rows += [r] * (len(s) - st)
            cols += range(st - 1, len(s) - 1)
            targets += s[st:]
        dev = self.device
        pos = torch.arange(S, device=dev)[None].expand(len(seqs), S)
        logits = self.module(
            ids.to(dev), pos, shims.causal_mask(S, dev)
        )  # [B, S, this rank's slice of the padded vocab]
        x = logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)].float()
        if self.temperature != 1.0:
            x = x / self.temperature
        if self._padded_cols is not None:  # the vocabulary's padding is no token
            x = x.masked_fill(self._padded_cols, -math.inf)
        # log p(target) over the whole vocabulary without gathering it: megatron's vocab-parallel
        # cross entropy (max and sum of exponentials all-reduced over the tensor-parallel group)
        return -vocab_parallel_cross_entropy(x, torch.tensor(targets, device=dev))

    def microbatches(self, idx: list[int], lengths: list[int]) -> list[list[int]]:
        """This rank's share ``idx`` of a minibatch in micro-batches (lists of batch indices)."""
        if not idx:
            return []
        if self.cfg.microbatching == "dynamic":
            groups = allocate_microbatches([lengths[i] for i in idx], self.cfg.max_tokens_per_microbatch)
        else:
            groups = split_fixed(len(idx), min(self.cfg.n_microbatches, len(idx)))
        return [[idx[j] for j in g] for g in groups]

    # ---- the step ---------------------------------------------------------------------------

    def _clip(self, max_norm: float) -> float:
        """``clip_grad_norm_`` over the whole model: sharded grads' squares summed over the
        tensor-parallel group, a replicated one counted once."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for n, p in zip(self._names, self._params):
            if p.grad is not None and (mapping.is_sharded(n) or self.layout.tp_rank == 0):
                sq += torch.linalg.vector_norm(p.grad) ** 2
        if self.layout.tp > 1:
            torch.distributed.all_reduce(sq, group=self.layout.tp_group)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self._params:
            if p.grad is not None:
                p.grad.mul_(coef)
        return float(total)

    def step(self, batch: list[Trajectory], version: int) -> dict:
        t0 = time.perf_counter()
        cfg, lay = self.cfg, self.layout
        prep = prepare_batch(batch, cfg.adv_norm)
        seqs, starts, n_out = prep.seqs, prep.starts, prep.n_out
        lengths = [len(s) for s in seqs]

        minibatches = split_fixed(len(batch), cfg.ppo_minibatches)
        mine = [deal_by_tokens(mb, lengths, lay.dp)[lay.dp_rank] for mb in minibatches]
        path = prox_path(cfg, len(minibatches))
        prox: dict[int, torch.Tensor] = {}
        n_prox = 0
        if path == "recompute":  # pi_prox of this rank's trajectories by the weights before the step
            with torch.no_grad():
                for mb in self.microbatches(sorted(i for m in mine for i in m), lengths):
                    lp = self.logprobs([seqs[i] for i in mb], [starts[i] for i in mb])
                    prox.update(zip(mb, lp.split([n_out[i] for i in mb])))
                    n_prox += 1
        versions = [torch.tensor(t.output_versions) for t in batch] if path == "loglinear" else None

        self.module.train()
        total = sum(prep.n_trained)  # policy tokens: environment tokens in multi-turn answers are not trained
        # (logprob_gap_*: step_parts.logprob_gap, present whatever the path so every rank reduces the same keys)
        sums = {
            k: 0.0 for k in ("loss", *STAT_KEYS, "logprob_gap_sum", "logprob_gap_tokens_sum") if not k.endswith("_max")
        }
        maxes = {**{k: -math.inf for k in STAT_KEYS if k.endswith("_max")}, "logprob_gap_max": 0.0}
        n_forward, grad_norms = 0, []
        for mbatch, my in zip(minibatches, mine):
            n_tokens = sum(prep.n_trained[i] for i in mbatch)  # the whole minibatch's, over all ranks
            self.optimizer.zero_grad(set_to_none=True)
            for idx in self.microbatches(my, lengths):
                logp = self.logprobs([seqs[i] for i in idx], [starts[i] for i in idx])
                loss, st = ppo_loss(
                    cfg, path, logp, prep, idx, prox=prox, versions=versions, version=version, n_tokens=n_tokens
                )
                loss.backward()
                n_forward += 1
                share = sum(prep.n_trained[i] for i in idx) / total
                sums["loss"] += float(loss.detach()) * n_tokens / total
                for k, v in st.items():
                    if k in maxes:
                        maxes[k] = max(maxes[k], v)
                    elif k.endswith("_sum"):
                        sums[k] += v
                    else:
                        sums[k] += v * share
            shims.finalize_model_grads(list(zip(self._names, self._params)), lay.dp_group, lay.tp_group)
            grad_norms.append(self._clip(cfg.optim.grad_clip))
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()

        sums.update(forward_passes=float(n_forward), prox_forward_passes=float(n_prox))
        sums, maxes = parallel.reduce_stats(sums, maxes, lay)
        if sums["logprob_gap_tokens_sum"]:
            sums["logprob_gap_mean"] = sums["logprob_gap_sum"] / sums["logprob_gap_tokens_sum"]
        return {
            **{k: v for k, v in sums.items() if k not in ("forward_passes", "prox_forward_passes")},
            **maxes,
            **batch_stats(batch, prep, version),
            "forward_passes": int(sums["forward_passes"]),
            "prox_logp_path": path,
            "prox_forward_passes": int(sums["prox_forward_passes"]),
            "grad_norm": max(grad_norms),
            "lr": lr,
            "train_time_s": time.perf_counter() - t0,
        }
