"""One rank of the NCCL probe (``python -m infra.gpu_smoke.nccl_probe RANK PORT``): two processes on
the same GPU join an NCCL group the way the distributed weight transport does
(``weight_layout.make_process_group``) and broadcast one tensor. Exit 0 and "ok" when the tensor
arrived intact."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from areal_core.rollout.weight_layout import make_process_group


def main(argv: list[str]) -> int:
    rank, port = int(argv[0]), int(argv[1])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = make_process_group("nccl", dist.PrefixStore("probe", store), rank, 2, 60.0)
    t = (
        torch.arange(1024, dtype=torch.bfloat16, device="cuda")
        if rank == 0
        else torch.zeros(1024, dtype=torch.bfloat16, device="cuda")
    )
    pg.broadcast(t, 0).wait()
    torch.cuda.synchronize()
    if not torch.equal(t.cpu(), torch.arange(1024, dtype=torch.bfloat16)):
        print("the broadcast arrived wrong")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
