"""Measure this machine's costs with the project's own engine and trainer, and fit the
simulator's cost model to them.

    areal-flow calibrate                      # configs/quickstart.yaml, ~1 min
    areal-flow calibrate --config C.yaml --out calibration.json [--quick]

What is timed (the config's model, dtype, sampling, trainer settings; the tiny model's
shape with random weights: the cost does not depend on the weights):

* decode: a `RolloutEngine` (the embedded server's engine, in this process, driven step
  by step, `rollout.torch_threads` threads) decoding batches of 1 to 256 sequences from
  prompts of 8 to 40 tokens (mixed, as a run's are: the engine's attention reads up to
  the longest row); each point is the mean step time over 16 steps, at the batch's
  context then;
* prefill: the engine's first step over n distinct prompts of L tokens (it samples one token);
* weight update: the engine taking a full set of weights in memory (what the tensor
  transport hands it) and applying it between two steps;
* train: `Trainer.step` (the config's trainer: objective, micro-batching, optimizer) on
  batches of B answers of heavy-tailed lengths (lognormal around a median of 12 to 48
  tokens) in groups of `rollout.n_samples` sharing a prompt of 8 to 30 tokens, at 1
  thread and at every core count up to this machine's (the synchronous trainer takes
  them all).

Every point is the fastest of its repetitions (3, `--quick` 1; train 5 and 2): other
work on the machine only slows a point down, and two OpenMP threads suffer most from it.

`calibrate_from` fits the cost model; the JSON holds the points, the fit, its errors on
the points and the machine. torch is imported here only: the simulator needs none.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from areal_core.sim.calibrate import calibrate_from, fit_errors
from areal_core.sim.cost import CostModel

if TYPE_CHECKING:
    from areal_core.rollout.config import SamplingConfig
    from areal_core.rollout.protocol import SamplingParams

DEFAULT_CONFIG = "configs/quickstart.yaml"  # the setting measured, unless another config is given
DEFAULT_CALIBRATION = "areal_core/sim/data/calibration_quickstart.json"  # where the fit goes, and is read from
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_PROMPT, DECODE_NEW, DECODE_CHUNK = (8, 40), 96, 16  # prompt lengths: uniform in the range
PREFILL_N, PREFILL_LEN = (1, 4, 16, 64), (16, 48, 96, 128)
TRAIN_B, TRAIN_MEDIAN, TRAIN_PROMPT = (64, 128, 256), (12, 24, 48), (8, 30)


def _best_time(fn, reps: int) -> float:
    """The fastest of `reps` calls: other work on the machine only ever slows a call down."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _engine(model, max_running: int):
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    return RolloutEngine(model, max_running=max_running, start=False, kv_slots=max_running, kv_capacity=256)


def _engine_sampling(sampling: SamplingConfig, max_new_tokens: int) -> SamplingParams:
    """The configured ``sampling`` as the engine takes it, ignoring EOS: each request generates
    exactly ``max_new_tokens`` (the embedded backend's own conversion, as its client sends it)."""
    from areal_core.rollout.backends.embedded.client import sampling_params

    return sampling_params(sampling.to_sampling(max_new_tokens=max_new_tokens, ignore_eos=True))


def measure_decode(model, sampling: SamplingConfig, vocab: int, reps: int, batches=DECODE_BATCHES) -> list[dict]:
    """Mean decode step time per chunk of steps; the batch's sequences start from prompts of
    mixed lengths, as a run's do (the engine's attention reads up to the longest row)."""
    rng = random.Random(0)
    engine = _engine(model, max(batches))
    sp = _engine_sampling(sampling, DECODE_NEW)
    points = []
    for b in batches:
        prompts = [_tokens(rng, rng.randint(*DECODE_PROMPT), vocab) for _ in range(b)]
        per_chunk: list[list[float]] = [[] for _ in range(DECODE_NEW // DECODE_CHUNK)]
        for _ in range(reps):
            futures = [engine.submit(p, sp) for p in prompts]
            engine.step()  # the prefill and the first token
            for chunk in per_chunk:
                t0 = time.perf_counter()
                for _ in range(DECODE_CHUNK):
                    engine.step()
                chunk.append((time.perf_counter() - t0) / DECODE_CHUNK)
            while engine.step():
                pass
            assert all(f.done() for f in futures)
        base = sum(len(p) for p in prompts)
        for k, times in enumerate(per_chunk):
            mid = 1 + k * DECODE_CHUNK + DECODE_CHUNK / 2  # output tokens per sequence, mid-chunk
            points.append({"batch": b, "context_tokens": base + b * mid, "step_s": min(times)})
    return points


def measure_prefill(model, sampling: SamplingConfig, vocab: int, reps: int) -> list[dict]:
    rng = random.Random(1)
    engine = _engine(model, max(PREFILL_N))
    sp = _engine_sampling(sampling, 1)
    points = []
    for n in PREFILL_N:
        for length in PREFILL_LEN:

            def once(n=n, length=length):
                engine.submit_many([(_tokens(rng, length, vocab), sp, None) for _ in range(n)])
                engine.step()

            once()  # first-call costs of this shape off the clock
            points.append({"tokens": n * length, "tokens_sq": n * length**2, "time_s": _best_time(once, reps)})
    return points


def measure_weight_update(model, reps: int) -> list[float]:
    engine = _engine(model, 1)
    times = []
    for v in range(1, reps + 2):
        named = {k: p.detach().clone() for k, p in model.named_parameters()}
        t0 = time.perf_counter()
        fut = engine.update_weights_from_tensors(named, v, "measure")
        engine.step()
        fut.result(timeout=60)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first pays one-time costs


def _batch(rng: random.Random, n_answers: int, median: float, group: int, vocab: int):
    """Answers of heavy-tailed lengths (lognormal, sigma 0.8, 1 to 4 x the median) in groups
    sharing a prompt of mixed length, as a run's batches are."""
    from areal_core.types import Trajectory

    batch = []
    for g in range(n_answers // group):
        prompt = _tokens(rng, rng.randint(*TRAIN_PROMPT), vocab)
        for s in range(group):
            n = max(1, min(int(4 * median), round(rng.lognormvariate(math.log(median), 0.8))))
            batch.append(
                Trajectory(
                    traj_id=f"m-p{g}-s{s}",
                    group_id=f"m-p{g}",
                    seq_no=g * group + s,
                    admit_version=0,
                    prompt_ids=prompt,
                    output_ids=_tokens(rng, n, vocab),
                    output_logprobs=[-1.0] * n,
                    output_versions=[0] * n,
                    finish_reason="length",
                    reward=5.0 if rng.random() < 0.4 else -5.0,
                    correct=None,
                )
            )
    return batch


def measure_train(make_model, cfg, vocab: int, threads: list[int], reps: int) -> list[dict]:
    """`Trainer.step` on one batch per (size, median answer length), the fastest of `reps`."""
    import torch

    from areal_core.trainer.trainer import Trainer

    rng = random.Random(2)
    group = cfg.rollout.n_samples
    points = []
    for n in threads:
        torch.set_num_threads(n)
        trainer = Trainer(make_model(), cfg.trainer, cfg.rollout.sampling.temperature, total_steps=10_000)
        trainer.step(_batch(rng, TRAIN_B[0], TRAIN_MEDIAN[0], group, vocab), 0)  # first-call costs
        for b in TRAIN_B:
            for median in TRAIN_MEDIAN:
                batch = _batch(rng, b, median, group, vocab)
                seqs = [len(t.prompt_ids) + len(t.output_ids) for t in batch]
                answers = sum(len(t.output_ids) for t in batch)
                time_s = _best_time(lambda trainer=trainer, batch=batch: trainer.step(batch, 0), reps)
                # tokens: what the trainer computes (a group's shared prompt once, as
                # SimConfig.train_shared_prompt counts them); tokens_sq: each answer's attention span
                points.append(
                    {
                        "tokens": answers + sum(len(t.prompt_ids) for t in batch[::group]),
                        "tokens_sq": sum(x * x for x in seqs),
                        "n_devices": n,
                        "time_s": time_s,
                        "answer_tokens": answers,
                        "threads": n,
                    }
                )
    return points


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(config_path: str = DEFAULT_CONFIG, quick: bool = False) -> dict:
    """Every measurement, the fitted cost model and its errors (see the module docstring)."""
    import torch

    from areal_core.experiment import load_config
    from areal_core.models import build_char_tokenizer, build_tiny

    cfg = load_config(config_path)
    if cfg.model.name != "tiny":
        raise ValueError(f"model.name: the measurement builds the tiny model; {config_path} names {cfg.model.name!r}")
    tok = build_char_tokenizer()
    vocab = len(tok)

    def make_model():
        return build_tiny(cfg.model.tiny, tok, cfg.seed)

    cores = os.cpu_count() or 1
    reps = 1 if quick else 3
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.rollout.torch_threads)
    engine_model = make_model()
    decode = measure_decode(engine_model, cfg.rollout.sampling, vocab, reps)
    prefill = measure_prefill(engine_model, cfg.rollout.sampling, vocab, reps)
    updates = measure_weight_update(engine_model, 5 if quick else 10)
    train = measure_train(make_model, cfg, vocab, sorted({1, cores}), 2 if quick else 5)
    max_positions = cfg.model.tiny.max_position_embeddings
    measurements = {
        "decode": decode,
        "prefill": prefill,
        "train": train,
        "weight_update_s": updates,
        # the engine's KV cache grows in host memory: it never runs out before max_running does
        "kv_capacity_tokens": cfg.rollout.max_running * max_positions,
    }
    cost = calibrate_from(measurements)
    return {
        "command": "areal-flow calibrate"
        + (f" --config {config_path}" if config_path != DEFAULT_CONFIG else "")
        + (" --quick" if quick else ""),
        "config": config_path,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {
            "cpu": _cpu_name(),
            "cores": cores,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "setup": {
            "model": "tiny",
            "params": sum(p.numel() for p in engine_model.parameters()),
            "rollout_torch_threads": cfg.rollout.torch_threads,
            "max_running": cfg.rollout.max_running,
            "trainer_threads_measured": sorted({1, cores}),
            "answers_per_group": cfg.rollout.n_samples,
        },
        "measurements": measurements,
        "fitted": asdict(cost),
        "fit_errors": fit_errors(measurements, cost),
    }


def load_calibration(path: str | os.PathLike) -> tuple[CostModel, dict]:
    """The fitted `CostModel` of a file `measure` wrote, and the whole file."""
    data = json.loads(Path(path).read_text())
    if "fitted" not in data:
        raise ValueError(f"{path}: not a calibration file (no 'fitted' cost model)")
    return CostModel(**data["fitted"]), data


def write_calibration(result: dict, out: str | os.PathLike) -> Path:
    """Write what `measure` returned as the calibration JSON at ``out``; returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def describe_fit(result: dict) -> str:
    """The fitted cost model and its errors on the measured points, a few lines of text."""
    f = result["fitted"]
    lines = [
        (
            f"decode step: {f['decode_overhead_s'] * 1e3:.2f} ms + {f['decode_flop_s_per_seq'] * 1e6:.1f} us/sequence "
            f"+ {f['decode_flop_s_per_ctx_token'] * 1e9:.1f} ns/context token (compute plane); memory plane "
            f"{f['decode_weight_read_s'] * 1e3:.2f} ms + {f['decode_kv_read_s_per_token'] * 1e9:.1f} ns/token"
        ),
        f"prefill: {f['prefill_overhead_s'] * 1e3:.2f} ms + {f['prefill_s_per_token'] * 1e6:.1f} us/token",
        (
            f"train: {f['train_step_overhead_s'] * 1e3:.1f} ms + {f['train_device_s_per_token'] * 1e6:.1f} "
            f"us/token on one core, scaling efficiency {f['train_scaling_eff']:.2f} per doubling"
        ),
        f"weight update: {f['weight_update_s'] * 1e3:.1f} ms",
    ]
    for kind, e in result["fit_errors"].items():
        lines.append(
            f"fit error, {kind}: median {e['median_rel_error']:.1%}, max {e['max_rel_error']:.1%} ({e['n']} points)"
        )
    lines.append(f"load average {result['machine']['load_average_1m']}")
    return "\n".join(lines)
