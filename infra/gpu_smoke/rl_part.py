"""Part (d): a short asynchronous RL run on the real task (``run_experiment``, unchanged), the engine in
its server process and the trainer in this one, on the same device, weights by the distributed
transport; then its checks: the ledger (every trajectory trained once), staleness <= eta, and the
weight update's pause.

NCCL cannot join two processes on one GPU (NCCL 2.5 and later refuse it: "Duplicate GPU detected"),
and one GPU is what a smoke machine has. So the part first tries NCCL between two processes on this
GPU (:mod:`infra.gpu_smoke.nccl_probe`, killed after ``probe_timeout_s``): where it works the run uses
NCCL, else gloo (the same transport and code path; the engine's receive buffers still on the GPU),
and the probe's error is recorded. ``--rl-transport`` forces one.

The pause: ``metrics.parquet``'s weight columns per step (``weight_push_s``: the previous version's
push until every server serves it; ``weight_stage_s``: the trainer's copy into the send buffer;
``weight_sync_wait_s``: the trainer waiting for the previous push) and each server's own time from
receiving to serving a version (its log: "weights of version N ... live in S s").
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from infra.gpu_smoke.common import REPO, Skip, median, model_overrides

LIVE = re.compile(r"weights of version (\d+) from (.+?) live in ([0-9.]+)s")
CURVE = ("step", "accuracy", "reward", "answer_len_mean", "staleness_max", "weight_push_s")


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nccl_probe(timeout_s: float) -> dict:
    """Broadcast one tensor over NCCL between two processes on this GPU; ``{"ok": ..., "error": ...}``."""
    port = _port()
    env = {
        **os.environ,
        "NCCL_DEBUG": "WARN",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "infra.gpu_smoke.nccl_probe", str(rank), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs, codes = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout_s)[0])
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0])
            codes.append(f"killed after {timeout_s:.0f} s")
    ok = codes == [0, 0]
    text = "\n".join(f"[rank {r}, exit {c}] {o.strip()[-1500:]}" for r, (c, o) in enumerate(zip(codes, outs)))
    return {"ok": ok, "exit": codes, "output": text}


def server_update_times(run_dir: Path) -> list[float]:
    times = []
    for log in sorted(run_dir.glob("rollout_server_*.log")):
        times += [float(m.group(3)) for m in LIVE.finditer(log.read_text(errors="replace"))]
    return times


def _stats(xs) -> dict:
    xs = [x for x in map(float, xs) if not math.isnan(x)]  # NaN (the first step has no earlier push) left out
    return {"n": len(xs), "median": median(xs), "max": max(xs) if xs else None}


def rl_part(args) -> dict:
    import pandas as pd

    from areal_core.device import resolve_device
    from areal_core.experiment import load_config
    from areal_core.run.setup import run_experiment

    device = resolve_device(args.device)
    probe = None
    choice = args.rl_transport
    if choice == "auto":
        if device.type == "cuda":
            probe = nccl_probe(args.probe_timeout_s)
            choice = "nccl" if probe["ok"] else "gloo"
        else:
            choice = "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise Skip("the nccl transport needs the engine and the trainer on a GPU")
    transport = {"kind": "tensor"} if choice == "tensor" else {"kind": "distributed", "backend": choice}
    over = {
        **model_overrides(args),
        "model.device": args.device,
        "trainer.max_steps": args.steps,
        "rollout.weight_transport": transport,
    }
    if args.model != "tiny":
        over["model.dtype"] = args.dtype
    if args.eval_problems is not None:
        over["eval.n_problems"] = args.eval_problems
    if args.rl_batch is not None:
        over["trainer.batch_size"] = args.rl_batch
    cfg = load_config(args.rl_config, over)
    run_dir = Path(args.rl_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # the smoke's own folder: a rerun starts afresh, not --resume
    summary = run_experiment(cfg, run_dir, progress=False)
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    weight_cols = sorted(c for c in metrics.columns if c.startswith("weight_"))
    ledger = summary["ledger_check"]
    stale_ok = summary["max_staleness_observed"] <= summary["eta"]
    server_times = server_update_times(run_dir)
    res = {
        "device": str(device),
        "model": cfg.model.name,
        "dtype": summary["dtype"],
        "config": str(args.rl_config),
        "transport": transport,
        "nccl_same_gpu_probe": probe,
        "steps": summary["steps"],
        "eta": summary["eta"],
        "batch_size": cfg.trainer.batch_size,
        "ledger_check": ledger,
        "ledger_ok": bool(ledger["ok"]),
        "max_staleness_observed": summary["max_staleness_observed"],
        "staleness_ok": stale_ok,
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "n_eval_problems": summary["n_eval_problems"],
        "effective_train_tokens_per_s": summary["effective_train_tokens_per_s"],
        "rl_time_s": summary["rl_time_s"],
        "wall_time_s": summary["wall_time_s"],
        "weight_columns": weight_cols,
        "weight": {c: _stats(metrics[c]) for c in weight_cols},
        "server_update_s": _stats(server_times),
        "curve": metrics[[c for c in CURVE if c in metrics.columns]].to_dict(orient="records"),
        "ok": bool(ledger["ok"]) and stale_ok and summary["steps"] == args.steps,
    }
    if device.type == "cuda":
        res["trainer_max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return res
