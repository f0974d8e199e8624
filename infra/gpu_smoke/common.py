"""What the smoke run's parts share: the results file (rewritten atomically after every part), the
models and the batches, timing that waits for the GPU."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _clean(x):
    """JSON-safe: NaN and infinities become None, tuples lists, tensors and numpy scalars plain numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` through a temporary file and a rename: a killed run leaves the last
    complete version, never a truncated one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


@dataclass
class Results:
    """``gpu_smoke.json``: every part's status (ok | failed | skipped), its time and its figures."""

    path: Path
    data: dict = field(default_factory=dict)

    def start(self, args: dict) -> None:
        self.data = {"args": args, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished": False, "parts": {}}
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)

    def run(self, name: str, fn, *args) -> dict:
        """Run part ``name`` (``fn(*args)`` returns its figures, or raises :class:`Skip`); record it
        with its status and seconds, whatever happens, and save."""
        self.data["parts"][name] = {"status": "running"}
        self.save()
        t0 = time.perf_counter()
        try:
            out = {"status": "ok", **fn(*args)}
        except Skip as s:
            out = {"status": "skipped", "reason": str(s)}
        except Exception as e:  # noqa: BLE001 - recorded with its traceback; the next part still runs
            out = {
                "status": "failed",
                "error": f"{type(e).__name__}: {e}"[:4000],
                "traceback": traceback.format_exc()[-6000:],
            }
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["parts"][name] = out
        self.save()
        return out

    def finish(self) -> None:
        self.data["finished"] = True
        self.data["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.save()


class Skip(Exception):
    """A part that cannot run here; the message says why (recorded as its reason)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Wall time of a block, after the GPU finished what it queued (``with Clock(dev) as c: ...; c.s``)."""

    def __init__(self, device: torch.device):
        self.device, self.s = device, 0.0

    def __enter__(self):
        sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.s = time.perf_counter() - self.t0


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


@dataclass
class Setup:
    """The model the parts share (loaded once), its tokenizer and the task's prompts."""

    args: object
    device: torch.device
    dtype: torch.dtype  # what the device computes in (model.dtype auto: bfloat16 on a bf16 GPU)
    dtype_why: str
    cfg: object  # the ExperimentConfig the model and task come from
    model32: torch.nn.Module  # float32, on the CPU: the reference every device figure is held against
    tokenizer: object
    prompts: list  # the task's train prompts (areal_core.types.Prompt)
    cache: dict = field(default_factory=dict)  # figures one part leaves for another

    def device_model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """A fresh copy of the model on the device, in ``dtype`` (default: the compute dtype)."""
        return copy.deepcopy(self.model32).to(self.device, dtype or self.dtype).eval()


def model_overrides(args) -> dict:
    """Config overrides that pick ``args.model`` without a warm start (the parts want the model as is)."""
    over = {"model.warm_start.steps": 0, "trainer.optim.continue_warm_start": False}
    if args.model != "tiny":
        over["model.name"] = args.model
    return over


def load_setup(args) -> Setup:
    """Load the model once (float32 on the CPU), its tokenizer and the task's prompts."""
    from areal_core.data.datasets import load_records, to_prompts
    from areal_core.device import resolve_device, resolve_dtype
    from areal_core.experiment import load_config
    from areal_core.models import load_base_model

    device = resolve_device(args.device)
    if args.model == "tiny":
        dtype, why = torch.float32, "the tiny model always runs in float32"
    else:
        dtype, why = resolve_dtype(args.dtype, device)
    cfg = load_config(args.config, {**model_overrides(args), "model.dtype": "float32"})
    train, _ = load_records(cfg.data)
    model, tokenizer = load_base_model(cfg.model, train_records=train, seed=0, progress=False)
    model = model.float().eval()
    prompts = to_prompts(train[: max(args.batches + [args.train_batch, args.check_batch]) * 2 + 200], tokenizer)
    return Setup(args, device, dtype, why, cfg, model, tokenizer, prompts)


def equal_length_prompts(prompts: list, n: int, max_len: int | None = None) -> list[list[int]]:
    """``n`` prompts cut to one length (the shortest of them, at most ``max_len``), repeated if the
    task has fewer: equal lengths keep HF ``generate`` free of padding, so both engines see the same."""
    ids = [list(prompts[i % len(prompts)].input_ids) for i in range(n)]
    L = min(len(x) for x in ids)
    if max_len:
        L = min(L, max_len)
    return [x[-L:] for x in ids]  # the end: the question and the assistant's turn


def fixed_batch(prompts: list, n: int, seq_len: int, vocab: int, group: int, seed: int, behaviour: float = -2.0):
    """``n`` trajectories of ``seq_len`` tokens each (prompt + random answer tokens), ``group`` answers
    per prompt (the packed forward shares it), rewards +-5 at random, every behaviour logprob ``behaviour``."""
    from areal_core.types import Trajectory

    rng = random.Random(seed)
    batch = []
    for i in range(n):
        p = list(prompts[(i // group) % len(prompts)].input_ids)[-(seq_len // 2) :]
        out = [rng.randrange(3, vocab) for _ in range(seq_len - len(p))]
        batch.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // group}",
                seq_no=i,
                admit_version=0,
                prompt_ids=p,
                output_ids=out,
                output_logprobs=[behaviour] * len(out),
                output_versions=[0] * len(out),
                reward=float(rng.choice((-5.0, 5.0))),
                correct=False,
                finish_reason="length",
            )
        )
    return batch


def text_batch(prompts: list, n: int, seq_len: int, group: int, reward: float = 5.0, behaviour: float = -3.0):
    """``n`` trajectories of ``seq_len`` tokens of real text: the task's prompts run together and cut
    into windows; trajectory ``i`` is window ``i // group``'s first half (shared by its group, as RL's
    answers share a prompt) and window ``i``'s second half as its answer, so the model predicts much of
    it and attention matters. Every reward ``reward``, every behaviour logprob ``behaviour``."""
    from areal_core.types import Trajectory

    stream = [t for p in prompts for t in p.input_ids]
    if len(stream) < n * seq_len:
        stream = stream * (n * seq_len // max(1, len(stream)) + 1)
    windows = [stream[k * seq_len : (k + 1) * seq_len] for k in range(n)]
    half = seq_len // 2
    return [
        Trajectory(
            traj_id=f"c{i}",
            group_id=f"cg{i // group}",
            seq_no=i,
            admit_version=0,
            prompt_ids=windows[i // group][:half],
            output_ids=windows[i][half:],
            output_logprobs=[behaviour] * (seq_len - half),
            output_versions=[0] * (seq_len - half),
            reward=reward,
            correct=True,
            finish_reason="length",
        )
        for i in range(n)
    ]


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"
