"""The few places where megatron-core 0.16.1 assumes CUDA, each replaced by a small CPU equivalent.

Measured with megatron-core 0.16.1 and torch 2.13.0+cpu (no Transformer Engine, no Apex): its CUDA RNG
tracker (``model_parallel_cuda_manual_seed`` calls ``torch.cuda.get_rng_state``), the rotary
embedding's ``inv_freq.to(torch.cuda.current_device())``, the default causal mask built on
``device="cuda"``, and DDP gradients that are not all-reduced without ``finalize_model_grads_func``;
plus the attention's scratch buffer. Every shim here is narrow: it replaces one
object megatron keeps for the purpose (its RNG-tracker global, its global scratch buffer, one rotary
module's method), never torch itself. :func:`apply_cpu_shims` installs the CPU-only ones; the causal
mask and :func:`finalize_model_grads` are used on every device, since this backend drives a plain
module (not megatron's DDP wrapper and ``forward_backward_func``, which hard-code CUDA). On a GPU none of
the CPU shims is installed: :func:`use_cuda_defaults` puts megatron's own RNG tracker and scratch buffer
back.

Not a shim but avoided: ``GPTModel(parallel_output=False)`` gathers the vocab-parallel logits into a
buffer on CUDA; the engine keeps them vocab-parallel and uses megatron's vocab-parallel cross entropy.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.utils import GlobalMemoryBuffer


class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """megatron's RNG tracker, keeping its named states in the CPU generator.

    Why: megatron forks its tracker around every attention dropout (``DotProductAttention``
    always enters ``get_cuda_rng_tracker().fork()``, even at p = 0) and
    ``model_parallel_cuda_manual_seed`` seeds it through ``torch.cuda.get_rng_state``, which fails
    without CUDA. Same names, same seeds, same fork semantics; only the generator differs.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker(seed: int, tp_rank: int) -> CpuRNGStatesTracker:
    """Replace megatron's tracker by :class:`CpuRNGStatesTracker`, seeded as
    ``model_parallel_cuda_manual_seed`` seeds the CUDA one (data-parallel: ``seed``; tensor-parallel:
    ``seed + 2718 + tp_rank``; expert-parallel: ``seed + 1024``, no expert parallelism here)."""
    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker  # what get_cuda_rng_tracker() returns from now on
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def _rotary_emb_on_cpu(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without its first line, which moves ``inv_freq`` to
    ``torch.cuda.current_device()`` (fails without CUDA). Non-interleaved RoPE only (the HF layout)."""
    if self.rotary_interleaved:
        raise NotImplementedError("interleaved RoPE is not used by Llama/Qwen checkpoints")
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def keep_rotary_on_cpu(model: torch.nn.Module) -> int:
    """Bind :func:`_rotary_emb_on_cpu` as ``get_emb`` of every rotary module of ``model``; returns how many.

    Why: megatron's rotary embedding moves its frequencies to CUDA at the first forward pass.
    """
    n = 0
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.get_emb = types.MethodType(_rotary_emb_on_cpu, mod)
            n += 1
    return n


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron's reusable scratch buffer, allocated on the CPU.

    Why: ``DotProductAttention`` (the local spec's attention) takes the [b * heads, sq, sk] score
    buffer from ``parallel_state.get_global_memory_buffer()``, which allocates on
    ``torch.cuda.current_device()``. (``baddbmm`` runs with ``beta=0``, so its content is ignored.)
    """

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        need = 1
        for d in tensor_shape:
            need *= d
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < need:
            buf = self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype)
        return buf[:need].view(*tensor_shape)


def install_cpu_memory_buffer() -> None:
    """Replace megatron's global memory buffer (created by ``initialize_model_parallel``)."""
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean causal attention mask of shape [1, 1, S, S], True where a query may NOT attend.

    Why: without an explicit mask megatron's attention builds its causal mask with
    ``device="cuda"``. Right-padded rows need nothing more: a real token never sees a later
    (padding) position, and padded positions' outputs are never read.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def _all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group``: one flat all-reduce; a missing gradient is zeros."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def finalize_model_grads(named_params: list[tuple[str, torch.nn.Parameter]], dp_group=None, tp_group=None) -> None:
    """What megatron's ``finalize_model_grads_func`` does for this model, on a plain module.

    Why: megatron expects ``forward_backward_func`` to call the config's ``finalize_model_grads_func``
    on a model wrapped in its DDP (whose grad buffers live on CUDA); **without it gradients are
    silently not all-reduced.** This backend runs a plain module under a torch optimizer, so it calls
    this after the last micro-batch of every minibatch. Two reductions, as megatron's:

    - data parallel (``dp_group``): every gradient summed over the ranks (the loss is normalised by
      the whole minibatch's token count, so the sum is the minibatch gradient); a rank without data
      this minibatch contributes zeros;
    - tensor parallel (``tp_group``): Qwen3's ``q_layernorm`` / ``k_layernorm`` weights are
      replicated but each rank only sees its own heads, so their gradients are summed over the
      tensor-parallel ranks (megatron's ``_allreduce_non_tensor_model_parallel_grads``). The other
      replicated weights (RMSNorms) already get full gradients: their input is the same on every rank.
    """
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        qk = [p for n, p in named_params if "q_layernorm" in n or "k_layernorm" in n]
        if qk:
            _all_reduce_grads(qk, tp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        _all_reduce_grads([p for _, p in named_params], dp_group)


def use_cuda_defaults(seed: int) -> None:
    """On a GPU: megatron's own CUDA RNG tracker (``model_parallel_cuda_manual_seed``, reset even if a
    CPU engine in this process installed :class:`CpuRNGStatesTracker`) and its own CUDA scratch buffer
    (replacing a :class:`CpuGlobalMemoryBuffer`). The rotary shim is per module and never applied here."""
    mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def apply_cpu_shims(model: torch.nn.Module, seed: int, tp_rank: int) -> None:
    """Install the CPU-only shims (RNG tracker, scratch buffer, rotary frequencies' device) for ``model``."""
    install_cpu_rng_tracker(seed, tp_rank)
    install_cpu_memory_buffer()
    keep_rotary_on_cpu(model)
