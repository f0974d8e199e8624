"""What every rank but 0 runs: build the engine rank 0 describes, then mirror its calls until told to stop.

A run with ``torchrun --nproc-per-node N`` and tensor-parallel size ``tp``::

    if int(os.environ["RANK"]) == 0:
        trainer = MegatronTrainer(model, cfg.trainer, temperature, steps, tp_size=tp)
        ...  # the run loop, unchanged: trainer.step / state_dict / load_state_dict
        trainer.close()
    else:
        follow_then_leave(tp)  # follow(), then leave the process groups

Rank 0 broadcasts each call (``init``, ``load_hf``, ``step``, ``gather_hf``, ``gather_hf_grads``, ``state``,
``load_state``, ``adopt_moments``, ``stop``) with its arguments; a follower runs the same
:class:`~areal_core.trainer.megatron.engine.MegatronEngine` method, so the collectives inside line up.
An exception on a follower propagates (its process exits non-zero; torchrun then stops the job).
"""

from __future__ import annotations

import os
import sys

from areal_core.net import address_towards
from areal_core.trainer.megatron import parallel
from areal_core.trainer.megatron.engine import MegatronEngine

COMMANDS = ("load_hf", "step", "gather_hf", "gather_hf_grads", "state", "load_state", "adopt_moments")


def follow(tp_size: int) -> int:
    """Join the process groups (as rank 0's trainer does), then serve rank 0's commands until
    ``stop``; returns the number of commands run (incl. ``init``)."""
    layout = parallel.init_parallel(tp_size)
    if layout.rank == 0:
        raise RuntimeError("follow() runs on ranks other than 0; rank 0 builds the MegatronTrainer")
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    print(
        f"megatron rank {layout.rank} of {layout.world} (tensor-parallel rank {layout.tp_rank} of {layout.tp}) "
        f"on {address_towards(master, 9)}, following rank 0 at {master}",
        file=sys.stderr,
        flush=True,
    )
    name, args = parallel.recv_command()
    if name == "stop":  # rank 0 rejected the model or config before building (it raises the error)
        return 0
    if name != "init":
        raise RuntimeError(f"a follower expected rank 0's 'init' command first, got {name!r}")
    engine = MegatronEngine(*args)
    n = 1
    while True:
        name, args = parallel.recv_command()
        if name == "stop":
            return n
        if name not in COMMANDS:
            raise RuntimeError(f"unknown command {name!r} from rank 0")
        getattr(engine, name)(*args)
        n += 1


def follow_then_leave(tp_size: int) -> int:
    """What a follower process runs: :func:`follow`, then leave the process groups
    (:func:`~areal_core.trainer.megatron.parallel.shutdown`) while the interpreter is still whole, as
    rank 0 does. A process that exits with its gloo group alive leaves gloo's worker threads to
    interpreter finalization, which can abort it (``terminate called without an active exception``,
    status 134) and so fail a run that stopped cleanly at a checkpoint."""
    try:
        return follow(tp_size)
    finally:
        parallel.shutdown()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m areal_core.trainer.megatron.follower",
        description="A megatron trainer rank other than 0 (RANK, WORLD_SIZE, MASTER_* "
        "from the environment, as torchrun sets them).",
    )
    ap.add_argument("--tensor-parallel-size", type=int, required=True)
    follow_then_leave(ap.parse_args(argv).tensor_parallel_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
