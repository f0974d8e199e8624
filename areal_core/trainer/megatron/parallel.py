"""Process groups for the megatron trainer: gloo on CPU, NCCL on GPUs, started by ``torchrun`` (or one
process alone).

Rank 0 drives the run; every call that needs the other ranks is a *command* it broadcasts
(:func:`send_command` / :func:`recv_command`), so the other ranks only run
:func:`areal_core.trainer.megatron.follower.follow`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from areal_core.net import address_towards, interface_of


@dataclass(frozen=True)
class Layout:
    rank: int
    world: int
    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    tp_group: object
    dp_group: object


def init_parallel(tp: int, backend: str = "gloo") -> Layout:
    """Join (or create) the process group (``backend``: gloo on CPU, nccl on GPUs) and megatron's
    tensor/data-parallel groups.

    Under ``torchrun`` the environment names the rendezvous; without it this is one process
    (world size 1, an in-memory store). ``tp`` must divide the world size; data parallelism
    takes the rest. Idempotent for the same ``tp`` and backend.
    """
    if dist.is_initialized() and dist.get_backend() != backend:
        raise RuntimeError(
            f"the process group is already initialised with backend {dist.get_backend()!r}, "
            f"not {backend!r} (one trainer per process; parallel.shutdown() in between)"
        )
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "gloo":
                gloo_interface_towards_master()
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the number of processes ({world})")
    if ps.model_parallel_is_initialized():
        have = ps.get_tensor_model_parallel_world_size()
        if have != tp:
            raise RuntimeError(
                f"megatron model parallelism is already initialised with tensor-parallel size "
                f"{have}, not {tp} (one trainer per process)"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return Layout(
        dist.get_rank(),
        world,
        tp,
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
        ps.get_data_parallel_group(),
    )


def gloo_interface_towards_master() -> str | None:
    """Have gloo listen where the other ranks reach this one: with the rendezvous (``MASTER_ADDR``) on
    the network and ``GLOO_SOCKET_IFNAME`` unset, set it to the interface on the route to the master.
    (gloo's own choice is the address this host's name resolves to, which on a cluster node can be
    one the other nodes cannot reach, e.g. a loopback alias.) The interface, or None where unchanged."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if "GLOO_SOCKET_IFNAME" in os.environ or master in ("127.0.0.1", "localhost", "::1"):
        return None
    name = interface_of(address_towards(master, int(os.environ.get("MASTER_PORT", "29500"))))
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def use_device(device: str | torch.device) -> tuple[torch.device, str]:
    """This rank's device and the process-group backend for it: a GPU (``cuda`` alone means this
    rank's, ``LOCAL_RANK`` as torchrun sets it, else 0), made the current one, with NCCL; the CPU with
    gloo. Call before :func:`init_parallel`: NCCL's collectives use the current GPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return device, "gloo"
    if device.type != "cuda":
        raise ValueError(f"the megatron trainer runs on 'cpu' or 'cuda', not {str(device)!r}")
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device, "nccl"


def shutdown() -> None:
    """Undo :func:`init_parallel` (megatron's groups, then the process group)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def send_command(name: str, *args) -> None:
    """Rank 0: tell every other rank to run ``name(*args)`` (no-op alone)."""
    if dist.get_world_size() > 1:
        dist.broadcast_object_list([(name, args)], src=0)


def recv_command() -> tuple[str, tuple]:
    """Any rank but 0: wait for rank 0's next command."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def comm_device() -> torch.device:
    """Where this process's collectives move tensors: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | None, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Rank 0's float32 ``tensors`` on every rank (others pass None), in ``shapes``' order, on
    :func:`comm_device`."""
    names = list(shapes)
    dev = comm_device()
    if dist.get_rank() == 0:
        flat = torch.cat([tensors[n].detach().to(dev, torch.float32).reshape(-1) for n in names])
    else:
        flat = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes.values()), device=dev)
    if dist.get_world_size() > 1:
        dist.broadcast(flat, src=0)
    out, offset = {}, 0
    for n in names:
        k = int(torch.Size(shapes[n]).numel())
        out[n] = flat[offset : offset + k].view(shapes[n]).clone()
        offset += k
    return out


def gather_tp(local: dict[str, torch.Tensor], layout: Layout) -> list[dict[str, torch.Tensor]]:
    """Every tensor-parallel rank's ``local`` dict (same names and shapes on each), one all-gather.
    Always copies: the result never aliases a live parameter or optimizer state."""
    if layout.tp == 1:
        return [{n: t.detach().clone() for n, t in local.items()}]
    names = list(local)
    flat = torch.cat([local[n].detach().float().reshape(-1) for n in names])
    parts = [torch.empty_like(flat) for _ in range(layout.tp)]
    dist.all_gather(parts, flat, group=layout.tp_group)
    out = []
    for part in parts:
        d, offset = {}, 0
        for n in names:
            k = local[n].numel()
            d[n] = part[offset : offset + k].view(local[n].shape)
            offset += k
        out.append(d)
    return out


def reduce_stats(sums: dict[str, float], maxes: dict[str, float], layout: Layout) -> tuple[dict, dict]:
    """Sum ``sums`` and max ``maxes`` over the data-parallel ranks (the same keys on every rank)."""
    if layout.dp == 1:
        return sums, maxes
    ks, km = sorted(sums), sorted(maxes)
    s = torch.tensor([sums[k] for k in ks], dtype=torch.float64, device=comm_device())
    m = torch.tensor([maxes[k] for k in km], dtype=torch.float64, device=comm_device())
    dist.all_reduce(s, group=layout.dp_group)
    if km:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=layout.dp_group)
    return dict(zip(ks, s.tolist())), dict(zip(km, m.tolist()))
