"""The command line: which parts run, their sizes, and the table printed last."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from infra.gpu_smoke.common import REPO, Results, describe_device, load_setup

PARTS = ("env", "engine", "trainer", "rl", "megatron")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m infra.gpu_smoke",
        description="A GPU smoke run: environment, engine vs HF generate, trainer, "
        "async RL, megatron (each part skipped or failed on its own)",
    )
    ap.add_argument("--out", default="runs/gpu_smoke", help="output folder (gpu_smoke.json, the RL run)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="compute dtype (auto: bfloat16 on a bf16 GPU; the tiny model is always float32)",
    )
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or an HF folder")
    ap.add_argument(
        "--config",
        default=str(REPO / "configs/smollm2_quickstart.yaml"),
        help="the task and trainer settings of parts engine/trainer/megatron",
    )
    ap.add_argument("--rl-config", default=None, help="the RL run's config (default: --config)")
    g = ap.add_argument_group("engine vs HF generate")
    g.add_argument("--batches", type=_ints, default=[64, 256], help="batch sizes (default 64,256)")
    g.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    g.add_argument("--prompt-len", type=int, default=None, help="cut prompts to at most this many tokens")
    g.add_argument("--reps", type=int, default=2, help="timed repetitions of each engine (default 2)")
    g = ap.add_argument_group("trainers")
    g.add_argument("--train-batch", type=int, default=128, help="trajectories per timed step (default 128)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per trajectory (default 256)")
    g.add_argument("--train-steps", type=int, default=3, help="timed torch-trainer steps (default 3)")
    g.add_argument("--microbatch-tokens", type=int, default=8192, help="max tokens per micro-batch (default 8192)")
    g.add_argument("--check-batch", type=int, default=16, help="trajectories in the equality batch (default 16)")
    g.add_argument("--check-len", type=int, default=128, help="tokens per equality trajectory (default 128)")
    g.add_argument("--megatron-steps", type=int, default=2, help="timed megatron steps (0: equality only)")
    g = ap.add_argument_group("async RL")
    g.add_argument("--steps", type=int, default=30, help="RL steps (default 30)")
    g.add_argument("--eval-problems", type=int, default=None, help="held-out problems before and after")
    g.add_argument("--rl-batch", type=int, default=None, help="trajectories per step (default: the config's)")
    g.add_argument(
        "--rl-transport",
        default="auto",
        choices=["auto", "nccl", "gloo", "tensor"],
        help="auto: NCCL where two processes can share the GPU, else gloo",
    )
    g.add_argument("--rl-dir", default=None, help="the RL run's folder, emptied first (default: <out>/rl)")
    g.add_argument("--probe-timeout-s", type=float, default=60.0, help="the NCCL probe's limit (default 60 s)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"unknown parts {bad}; choose from {', '.join(PARTS)}")
    args.rl_config = args.rl_config or args.config
    args.rl_dir = args.rl_dir or str(Path(args.out) / "rl")
    return args


def _free(device_type: str) -> None:
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(args) -> Results:
    from transformers.utils import logging as hf_logging

    from infra.gpu_smoke.engine_part import engine_part
    from infra.gpu_smoke.env_part import env_part
    from infra.gpu_smoke.rl_part import rl_part
    from infra.gpu_smoke.trainer_part import megatron_part, trainer_part

    hf_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # (the GGUF loader's own bar would fill the log)
    prefect_before = "prefect" in sys.modules
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = Results(out / "gpu_smoke.json")
    res.start(vars(args))
    setup = None

    def model_part():
        nonlocal setup
        setup = load_setup(args)
        return {
            "model": args.model,
            "device": describe_device(setup.device),
            "dtype": str(setup.dtype).removeprefix("torch."),
            "dtype_why": setup.dtype_why,
            "parameters": sum(p.numel() for p in setup.model32.parameters()),
        }

    def needs_model(fn):
        def go():
            if setup is None:
                from infra.gpu_smoke.common import Skip

                raise Skip(f"the model did not load: {res.data['parts'].get('model', {}).get('error', '?')}")
            return fn(setup)

        return go

    dev_type = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    for name in PARTS:
        if name not in args.parts:
            continue
        if name == "env":
            res.run("env", env_part, args)
        elif name == "rl":
            res.run("rl", rl_part, args)
        else:
            if setup is None and "model" not in res.data["parts"]:
                res.run("model", model_part)
            res.run(
                name, needs_model({"engine": engine_part, "trainer": trainer_part, "megatron": megatron_part}[name])
            )
        _free(dev_type)
    # whether this run's code imported Prefect (None: it was imported before the run, in this process)
    res.data["prefect_imported"] = None if prefect_before else "prefect" in sys.modules
    res.finish()
    return res


def _f(x, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def headline(name: str, p: dict) -> str:
    if p["status"] != "ok":
        return p.get("reason") or p.get("error", "")[:150]
    if name == "env":
        return (
            f"{p.get('gpu', 'no GPU')}, torch {p['torch']} (CUDA {p['torch_cuda']}), "
            f"bf16 {p.get('bf16_supported', '-')}, bf16 matmul {p.get('matmul_bf16_tflops', '-')} TFLOP/s"
        )
    if name == "model":
        return f"{p['model']} on {p['device']}, {p['dtype']} ({p['dtype_why']})"
    if name == "engine":
        rows = "; ".join(
            f"bs {r['batch']}: {_f(r['engine_tokens_per_s'])} vs HF {_f(r['hf_generate_tokens_per_s'])} "
            f"tok/s ({r['engine_over_hf']:.2f}x)"
            for r in p["rows"]
        )
        lp = p["logprobs"]
        return f"{rows}; logprobs mean|d| {lp['mean_abs']:.4f} p99 {lp['p99_abs']:.3f} ok={p['ok']}"
    if name in ("trainer", "megatron"):
        eq = p["equality"]
        speed = f"{_f(p.get('tokens_per_s'))} tok/s fwd+bwd+AdamW, " if p.get("tokens_per_s") else ""
        return (
            f"{speed}loss {eq['loss']:.5f} vs CPU fp32 {eq['cpu_float32_loss']:.5f} "
            f"(rel {eq['loss_rel_diff']:.1e} <= {eq['tolerance']:.0e}) ok={p['ok']}"
        )
    if name == "rl":
        push = p["weight"].get("weight_push_s", {})
        return (
            f"{p['steps']} steps, {p['transport']}, ledger ok={p['ledger_ok']}, staleness "
            f"{p['max_staleness_observed']}<={p['eta']}, push median {_f(push.get('median'), '.3f')} s, "
            f"acc {p['accuracy_before']:.3f}->{p['accuracy_after']:.3f}"
        )
    return ""


def safe_headline(name: str, p: dict) -> str:
    """The headline, or where a part's figures lack what it reads, a pointer to the JSON."""
    try:
        return headline(name, p)
    except (KeyError, TypeError, ValueError) as e:
        return f"(no headline: {e!r} missing or odd; see gpu_smoke.json)"


def print_table(res: Results) -> None:
    print(f"\n{'part':<9} {'status':<8} {'seconds':>8}  headline")
    for name, p in res.data["parts"].items():
        print(f"{name:<9} {p['status']:<8} {p.get('seconds', 0):8.1f}  {safe_headline(name, p)}")
    print(json.dumps({"json": str(res.path), "prefect_imported": res.data["prefect_imported"]}))


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    print(f"total {time.perf_counter() - t0:.0f} s")
    failed = [n for n, p in res.data["parts"].items() if p["status"] == "failed"]
    return 1 if failed else 0
