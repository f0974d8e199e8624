"""How much one core's work slows the other's: ``python -m bench core_interference [--quick]``.

Asynchronous training on two cores computes the trainer's step on one core while the rollout
server generates on the other; it pays only as far as the two cores are independent. Where the
two CPUs a machine lends are one physical core's two hardware threads, or share their caches and
memory bandwidth, each computes slower beside the other, and a trainer thread beside a generating
server runs slower than one thread alone.

Two worker processes, each pinned to one CPU (``os.sched_setaffinity``) with one torch thread,
run kernels at the shapes of the SmolLM2-135M workload:

* ``bf16 products (trainer)``: ``[1024, 576] @ [576, 1536]`` in bfloat16, an MLP projection over
  a training batch's tokens;
* ``bf16 products (decode)``: ``[64, 576] @ [576, 1536]`` in bfloat16, the same projection over a
  decode step's 64 rows;
* ``float32 products (trainer)``: the trainer's shape in float32;
* ``memory traffic``: copying 256 MiB, a pass over memory no cache holds.

For each pair the first CPU's kernel runs a fixed number of iterations (about 0.4 s worth, set
alone after half a second's warm-up) alone, then again while the second CPU loops its kernel from before the
start to after the end; REPS interleaved repetitions. The slowdown is the time beside over the
time alone, within a repetition: 1 where the cores are independent, up to about 2 where the two
CPUs share one core's units. A shared host's speed drifts from one second to the next, so a single
ratio can be far off either way: many short repetitions, and the median with its quartiles,
say what holds. Where bfloat16 products are not worth running (no AVX-512) the
bfloat16 rows say so in their times; they still run.

``--quick``: a tenth of the time, one repetition: a smoke check.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable

from bench.common import format_table

REPS, SECONDS = 15, 0.4
WARM_UP_S = 0.5  # each kernel's first half second in a worker, untimed
# (kernel on the first CPU, kernel looping on the second)
PAIRS = (
    ("bf16 products (trainer)", "bf16 products (trainer)"),
    ("bf16 products (trainer)", "bf16 products (decode)"),
    ("bf16 products (decode)", "bf16 products (decode)"),
    ("float32 products (trainer)", "float32 products (trainer)"),
    ("memory traffic", "memory traffic"),
    ("bf16 products (trainer)", "memory traffic"),
)


def kernel(name: str) -> Callable[[], object]:
    """One iteration of the named kernel, its tensors made once."""
    import torch

    if name == "memory traffic":
        src, dst = torch.ones(64 << 20), torch.empty(64 << 20)  # 256 MiB each
        return lambda: dst.copy_(src)
    rows = {"trainer": 1024, "decode": 64}[name.rsplit("(", 1)[1].rstrip(")")]
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
    x, w = torch.randn(rows, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    return lambda: torch.matmul(x, w)


def _worker(cpu: int, commands: mp.Queue, results: mp.Queue, stop: mp.Event) -> None:
    """Pinned to ``cpu`` with one torch thread: ``("time", name, iters)`` answers the seconds of
    ``iters`` iterations; ``("calibrate", name, seconds)`` the iterations that take about that long;
    ``("loop", name)`` answers "looping" at once and the iterations done once ``stop`` is set."""
    import torch

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    kernels: dict[str, Callable[[], object]] = {}
    while (cmd := commands.get()) is not None:
        op, name, arg = (*cmd, None)[:3]
        if name not in kernels:
            kernels[name] = kernel(name)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < WARM_UP_S:  # first-call costs and a cold core off the clock
                kernels[name]()
        run = kernels[name]
        if op == "loop":
            results.put("looping")
            n = 0
            while not stop.is_set():
                run()
                n += 1
            results.put(n)
        elif op == "calibrate":
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < arg:
                run()
                n += 1
            results.put(n)
        else:
            t0 = time.perf_counter()
            for _ in range(arg):
                run()
            results.put(time.perf_counter() - t0)


class Pair:
    """Two pinned workers, on the first two CPUs this process may use."""

    def __init__(self) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit(f"core_interference needs two CPUs; this process may use {cpus}")
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.cmd = [ctx.Queue(), ctx.Queue()]
        self.res = [ctx.Queue(), ctx.Queue()]
        self.cpus = cpus[:2]
        self.procs = [
            ctx.Process(target=_worker, args=(c, self.cmd[i], self.res[i], self.stop), daemon=True)
            for i, c in enumerate(self.cpus)
        ]
        for p in self.procs:
            p.start()

    def ask(self, i: int, *cmd) -> object:
        self.cmd[i].put(cmd)
        return self.res[i].get(timeout=600)

    def beside(self, name: str, iters: int, other: str) -> tuple[float, int]:
        """Seconds of ``iters`` of ``name`` on the first CPU while ``other`` loops on the second, and
        the iterations the second did meanwhile."""
        self.stop.clear()
        if self.ask(1, "loop", other) != "looping":
            raise RuntimeError("the second worker did not start looping")
        time.sleep(0.05)  # its loop under way before the clock starts
        seconds = self.ask(0, "time", name, iters)
        self.stop.set()
        return seconds, self.res[1].get(timeout=600)

    def close(self) -> None:
        self.stop.set()  # a worker still looping (an error mid-pair) stops and reads its last command
        for q in self.cmd:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)


def measure(pair: Pair, reps: int, seconds: float) -> list[dict]:
    """Per pair of kernels: the first's seconds alone and beside the second, REPS interleaved times."""
    rows = []
    for name, other in PAIRS:
        iters = max(1, int(pair.ask(0, "calibrate", name, seconds)))
        alone, beside = [], []
        for _ in range(reps):
            alone.append(pair.ask(0, "time", name, iters))
            beside.append(pair.beside(name, iters, other)[0])
        slowdowns = [b / a for a, b in zip(alone, beside)]
        rows.append(
            {
                "kernel": name,
                "beside": other,
                "iterations": iters,
                "alone_ms": [1e3 * s / iters for s in alone],
                "beside_ms": [1e3 * s / iters for s in beside],
                "slowdowns": slowdowns,
                "slowdown": statistics.median(slowdowns),
            }
        )
        print(f"  {name} beside {other}: {statistics.median(slowdowns):.2f}x", flush=True)
    return rows


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``xs`` (the middle half of the repetitions lies between)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    heads = ["kernel on the first CPU", "beside, on the second", "ms alone", "ms beside", "slowdown (quartiles)"]
    body = [
        [
            r["kernel"],
            r["beside"],
            f"{statistics.median(r['alone_ms']):.2f}",
            f"{statistics.median(r['beside_ms']):.2f}",
            "{:.2f} ({:.2f}-{:.2f})".format(r["slowdown"], *quartiles(r["slowdowns"])),
        ]
        for r in rows
    ]
    return heads, body


def _slug(name: str) -> str:
    return "_".join(name.replace("(", "").replace(")", "").split())


def run(quick: bool) -> dict:
    reps, seconds = (1, SECONDS / 10) if quick else (REPS, SECONDS)
    pair = Pair()
    try:
        rows = measure(pair, reps, seconds)
    finally:
        pair.close()
    heads, body = table(rows)
    print(format_table(heads, body, title=f"one torch thread on each of CPUs {pair.cpus[0]} and {pair.cpus[1]}"))
    if quick:
        print("note: --quick is a smoke check (a tenth of the time, one repetition): not a result")
    setup = {"cpus": pair.cpus, "repetitions": reps, "seconds_alone": seconds}
    summary = {f"slowdown_{_slug(r['kernel'])}_beside_{_slug(r['beside'])}": r["slowdown"] for r in rows}
    return {"setup": setup, "rows": rows, "summary": summary}
