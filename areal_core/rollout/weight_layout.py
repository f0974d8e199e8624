"""What both ends of a weight transport agree on: tensor specs, a flat layout, process groups."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIGN = 64  # bytes: every tensor of a flat buffer starts on a cache line


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # a key of DTYPES (SGLang sends these names too)
    shape: tuple[int, ...]
    offset: int = 0  # bytes into a flat buffer (shared memory); unused by broadcasts

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"tensor {self.name}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}") from None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=self.torch_dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent as weights (supported: {', '.join(DTYPES)})")


def flat_layout(named: dict[str, torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Specs placing ``named``'s tensors one after another (aligned) in one buffer, and its size."""
    specs, offset = [], 0
    for name, t in named.items():
        spec = TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset)
        specs.append(spec)
        offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    return specs, max(offset, 1)


def views_of(buf, specs: list[TensorSpec], where: str) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` (a writable buffer) at the specs' offsets, checked against its size."""
    out = {}
    for s in specs:
        if s.offset < 0 or s.offset + s.nbytes > len(buf):
            raise ValueError(
                f"{where}: tensor {s.name} ({s.nbytes} bytes at offset {s.offset}) "
                f"lies outside the buffer of {len(buf)} bytes"
            )
        n = s.nbytes // torch.tensor([], dtype=s.torch_dtype).element_size()
        out[s.name] = torch.frombuffer(buf, dtype=s.torch_dtype, count=n, offset=s.offset).view(s.shape)
    return out


def make_process_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float, address: str | None = None
) -> dist.ProcessGroup:
    """A process group of its own (the default group stays free for the trainer's parallelism):
    gloo on CPU, NCCL on GPU, the same calls either way.

    ``address``: this process's address on the network the group spans (the trainer: the
    transport's master_address; a server: its address on the route to it), where gloo listens
    for its peers. Without it (or with ``GLOO_SOCKET_IFNAME`` set) gloo takes the address its host
    name resolves to, which on a host with several networks may be one the peers cannot reach."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        if address is None or os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("weight-update backend 'nccl' needs CUDA, which this process does not have")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight-update backend must be 'gloo' or 'nccl', got {backend!r}")
