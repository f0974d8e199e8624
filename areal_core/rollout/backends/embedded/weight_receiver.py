"""The server side of the weight transports: weights that arrive in memory, checked before use.

* :func:`check_weights`: named tensors against the model (names, shapes, dtypes), or LoRA adapters
  against its weights, so a bad update leaves the running weights intact;
* :class:`SharedMemoryReader`: the ``tensor`` transport: views of a shared-memory segment that the
  trainer on the same host filled (``weight_transport.TensorTransport`` writes it);
* :class:`DistributedReceiver`: the ``distributed`` transport: process groups joined through
  ``/init_weights_update_group`` and tensors received by broadcast from rank 0 (the trainer)
  through ``/update_weights_from_distributed``, as SGLang's servers do (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import datetime
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

from areal_core.net import address_towards
from areal_core.rollout.weight_layout import TensorSpec, make_process_group, views_of
from areal_core.trainer.lora import check_adapters, is_adapter_name


def check_weights(model: torch.nn.Module, named: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``named`` checked against ``model``'s parameters: every parameter present (a tied LM head
    may be left out: it is the embedding), no unknown name, the same shapes and dtypes (the trainer
    sends what the server runs: a silent conversion would hide a precision mismatch between the
    two). Returns the tensors, ready for ``kv_forward.apply_weights``.

    An update of LoRA adapters (every name ``<module>.lora_A`` / ``.lora_B``, float32, shapes that
    fit the module's weight) is checked by ``lora.check_adapters`` and returned as it is: the engine
    merges it into the base weights (``lora.AdapterMerger``)."""
    if any(is_adapter_name(n) for n in named):
        check_adapters(model, named, source)
        return dict(named)
    params = dict(model.named_parameters())  # tied parameters appear once
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    staged = {}
    for name, t in named.items():
        if name in tied:
            continue
        p = params.get(name)
        if p is None:
            raise ValueError(f"{source}: tensor {name!r} does not belong to the model")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
        if t.dtype != p.dtype:
            raise ValueError(
                f"{source}: {name} arrives as {_name(t.dtype)}, the server's model is "
                f"{_name(p.dtype)}: send weights in the dtype the servers run (rollout.dtype)"
            )
        staged[name] = t
    missing = sorted(set(params) - set(staged))
    if missing:
        raise ValueError(f"{source}: {len(missing)} of the model's tensors are missing, e.g. {missing[:3]}")
    return staged


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SharedMemoryReader:
    """Open shared-memory segments by name (once each) and view tensors in them without copying.

    The trainer does not write a segment again before the update that reads it has returned,
    and the engine copies the views into its parameters before it answers, so views suffice."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def tensors(self, shm_name: str, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        shm = self._open.get(shm_name)
        if shm is None:
            try:
                shm = shared_memory.SharedMemory(name=shm_name, create=False)
            except FileNotFoundError:
                raise ValueError(
                    f"shared-memory segment {shm_name!r} does not exist on this host "
                    "(the tensor transport needs the trainer on the same machine)"
                ) from None
            # the trainer owns (and unlinks) the segment: Python < 3.13 would unlink it when we exit
            resource_tracker.unregister(shm._name, "shared_memory")
            self._open[shm_name] = shm
        return views_of(shm.buf, specs, f"shared-memory segment {shm_name!r}")

    def close(self) -> None:
        for shm in self._open.values():
            shm.close()
        self._open.clear()


class DistributedReceiver:
    """Process groups this server joined, by name; receives broadcasts from rank 0.

    The receive buffers are allocated on ``device``, the engine's: NCCL moves CUDA tensors only, so
    a server on a GPU receives straight into GPU memory; gloo takes CPU and CUDA tensors alike. One
    code path for both backends: only the buffers' device differs."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._groups: dict[str, dist.ProcessGroup] = {}

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 300.0,
    ) -> None:
        """Join (blocking) the group whose rank 0 is the trainer; this server is ``rank_offset``."""
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size {world_size})")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"weight-update backend 'nccl' moves GPU tensors only, and this server's engine "
                f"runs on {self.device}: use backend 'gloo'"
            )
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self._groups[group_name] = make_process_group(
            backend,
            dist.PrefixStore(group_name, store),
            rank_offset,
            world_size,
            timeout_s,
            address_towards(master_address, master_port),
        )

    def buffer(self, spec: TensorSpec) -> torch.Tensor:
        """An uninitialised tensor for ``spec`` on this server's device."""
        return torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def receive(self, group_name: str, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """Receive one broadcast per tensor, in order, from rank 0 of ``group_name`` (blocking: on a
        GPU it returns once the bytes have landed, not merely once the copies are queued)."""
        pg = self._groups.get(group_name)
        if pg is None:
            raise ValueError(
                f"no weight-update group {group_name!r} on this server "
                f"(joined: {sorted(self._groups) or 'none'}); call /init_weights_update_group first"
            )
        out = {}
        for s in specs:
            t = self.buffer(s)
            pg.broadcast(t, 0).wait()  # on CUDA this orders the current stream after the broadcast
            out[s.name] = t
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        self._groups.clear()
