"""Checkpoint cost per training step: today's full checkpoint every step vs a cadence, full or delta.

The model is trained for real (AdamW, lr 1.5e-4, random token batches, causal LM
loss), so deltas see realistic weight moves. Each strategy replays the same seeded
run; every checkpoint carries the weights, config, tokenizer and the optimizer state
(``resume/trainer.pt``, as ``run_state.encode`` writes it), like the run's own.

* ``today``: ``CheckpointStore.publish`` (save_pretrained) at every step, on the
  training thread;
* ``writer every step``: ``snapshot_model`` on the training thread, the write on
  ``CheckpointWriter``'s thread, every step;
* ``cadence N full`` / ``cadence N delta (full every K)``: the same, at every N-th
  step and the final one (``checkpoint_due``); the final one is forced full.

Per strategy: checkpoints written, bytes written per training step (all files, and
weights only), the writer's time per checkpoint, and the time the training loop
spent on checkpoints per step (snapshot + waiting for the previous write, or the
whole publish for ``today``) next to the training step itself.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time

import torch

from bench.common import format_table, work_dir

LR = 1.5e-4


def _train_step(model, opt, gen, batch: tuple[int, int]) -> None:
    ids = torch.randint(0, model.config.vocab_size, batch, generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _resume_files(opt) -> dict[str, bytes]:
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict()}, buf)  # what run_state.encode stores as trainer.pt
    return {"resume/trainer.pt": buf.getvalue()}


def _replay(make, strategy: dict, steps: int, batch: tuple[int, int], tmp: str) -> dict:
    """Train ``steps`` steps from the same seed, checkpointing as ``strategy`` says."""
    from areal_core.storage import CheckpointStore, CheckpointWriter, snapshot_model
    from areal_core.storage.config import StorageConfig, checkpoint_due

    model, tok = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    folder = tempfile.mkdtemp(dir=tmp, prefix="ckpt-")
    store = CheckpointStore(folder)
    cfg = StorageConfig(
        checkpoint_every=strategy["every"],
        format=strategy.get("format", "full"),
        full_every=strategy.get("full_every", 5),
        keep_last=2,
    )
    writer = CheckpointWriter.from_config(store, cfg)
    results, train_s, ckpt_s = [], 0.0, 0.0
    last_step = None

    def checkpoint(step: int, final: bool) -> float:
        t0 = time.perf_counter()
        if strategy["name"] == "today":
            t = time.perf_counter()
            store.publish(step, model, tok, meta={"step": step}, extra=_resume_files(opt))
            manifest = store.read_manifest(step)
            results.append(
                {
                    "format": "full",
                    "write_s": time.perf_counter() - t,
                    "bytes": sum(f["size"] for f in manifest["files"]),
                    "weight_bytes": next(f["size"] for f in manifest["files"] if f["path"] == "model.safetensors"),
                }
            )
            store.prune(cfg.keep_last)
        else:
            tensors, files = snapshot_model(model, tok)
            files.update(_resume_files(opt))
            writer.submit(step, tensors, files, meta={"step": step}, full=final).add_done_callback(
                lambda f: results.append(
                    {
                        "format": f.result().format,
                        "write_s": f.result().write_s,
                        "bytes": f.result().bytes_written,
                        "weight_bytes": f.result().weight_bytes,
                    }
                )
            )
        return time.perf_counter() - t0

    try:
        checkpoint(0, False)  # v0: the run publishes its starting weights
        last_step = 0
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            _train_step(model, opt, gen, batch)
            train_s += time.perf_counter() - t0
            if checkpoint_due(step, last_step, None, 0.0, cfg, final=step == steps):
                ckpt_s += checkpoint(step, step == steps)
                last_step = step
        writer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    written = results[1:]  # v0 is the same for every strategy; the per-step figures leave it out
    return {
        "strategy": strategy["name"],
        "checkpoints": len(written),
        "formats": [r["format"] for r in results],
        "bytes_per_step": sum(r["bytes"] for r in written) / steps,
        "weight_bytes_per_step": sum(r["weight_bytes"] for r in written) / steps,
        "delta_weight_bytes": [r["weight_bytes"] for r in written if r["format"] == "delta"],
        "full_weight_bytes": next(r["weight_bytes"] for r in results if r["format"] == "full"),
        "write_s_per_checkpoint": sum(r["write_s"] for r in written) / len(written),
        "checkpoint_s_per_step": ckpt_s / steps,  # on the training loop's critical path
        "train_s_per_step": train_s / steps,
    }


def _tiny():
    from bench.models import build_tiny_model

    return build_tiny_model(0)


def _smollm2():
    from transformers import AutoTokenizer

    from bench.models import load, model_folder

    return load("smollm2-135m").train(), AutoTokenizer.from_pretrained(model_folder("smollm2-135m"))


def bench_model(name: str, make, steps: int, every: int, full_every: int, batch, tmp: str) -> list[dict]:
    strategies = [
        {"kind": "today", "name": "today", "every": 1},
        {"kind": "writer_full", "name": "writer every step", "every": 1},
        {"kind": "cadence_full", "name": f"cadence {every} full", "every": every},
        {
            "kind": "cadence_delta",
            "name": f"cadence {every} delta (full every {full_every})",
            "every": every,
            "format": "delta",
            "full_every": full_every,
        },
    ]
    return [
        {"model": name, "kind": s["kind"], "steps": steps, **_replay(make, s, steps, batch, tmp)} for s in strategies
    ]


def run(quick: bool) -> dict:
    tmp = str(work_dir("checkpoints", quick))
    setups = {
        "tiny": dict(make=_tiny, steps=20 if quick else 60, every=5, full_every=5, batch=(4, 32) if quick else (8, 64))
    }
    if not quick:
        setups["smollm2-135m"] = dict(make=_smollm2, steps=20, every=5, full_every=5, batch=(2, 64))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the training loop: one intra-op thread, the writer has the other core
    try:
        rows = [r for name, s in setups.items() for r in bench_model(name, tmp=tmp, **s)]
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    mb = 1e6
    print(
        format_table(
            [
                "model",
                "strategy",
                "ckpts",
                "MB/step",
                "weights MB/step",
                "delta/full",
                "write s/ckpt",
                "ckpt s/step",
                "train s/step",
            ],
            [
                (
                    r["model"],
                    r["strategy"],
                    r["checkpoints"],
                    r["bytes_per_step"] / mb,
                    r["weight_bytes_per_step"] / mb,
                    (
                        sum(r["delta_weight_bytes"]) / len(r["delta_weight_bytes"]) / r["full_weight_bytes"]
                        if r["delta_weight_bytes"]
                        else None
                    ),
                    r["write_s_per_checkpoint"],
                    r["checkpoint_s_per_step"],
                    r["train_s_per_step"],
                )
                for r in rows
            ],
            title=f"checkpoint cost per training step (AdamW lr {LR}, local disk, {os.cpu_count()} cores)",
        )
    )

    def pick(model: str, kind: str) -> dict:
        return next(r for r in rows if r["model"] == model and r["kind"] == kind)

    summary = {}
    for model in setups:
        key = model.split("-")[0]
        today, full, dlt = pick(model, "today"), pick(model, "cadence_full"), pick(model, "cadence_delta")
        summary[f"checkpoint_mb_per_step_{key}_today"] = today["bytes_per_step"] / mb
        summary[f"checkpoint_mb_per_step_{key}_cadence_full"] = full["bytes_per_step"] / mb
        summary[f"checkpoint_mb_per_step_{key}_cadence_delta"] = dlt["bytes_per_step"] / mb
        summary[f"checkpoint_delta_over_full_weights_{key}"] = (
            sum(dlt["delta_weight_bytes"]) / len(dlt["delta_weight_bytes"]) / dlt["full_weight_bytes"]
        )
        summary[f"checkpoint_critical_path_s_per_step_{key}_today"] = today["checkpoint_s_per_step"]
        summary[f"checkpoint_critical_path_s_per_step_{key}_cadence_delta"] = dlt["checkpoint_s_per_step"]
    return {
        "setup": {k: {kk: vv for kk, vv in v.items() if kk != "make"} for k, v in setups.items()},
        "lr": LR,
        "torch_threads": 1,
        "store": "local disk, keep_last 2",
        "rows": rows,
        "summary": summary,
    }
