"""The simulator, calibrated on this machine, against runs of the project measured here.

    areal-flow simulate RUN_DIR [RUN_DIR ...] [--calibration FILE] [--seeds 3]

Each run folder (what `areal-flow train` writes) gives the setting: its config.json (batch,
answers per prompt, eta, weight-update mode, servers and threads), its summary.json (the
trainer's thread count and the measured `effective_train_tokens_per_s`) and its
ledger.parquet (the answer length of every trained trajectory, and through the
trajectory ids the prompts, whose mean length is taken). The simulator replays the
setting with the calibrated cost model and the run's own answer lengths (drawn with
replacement) and predicts the same figure: answer tokens trained per second after the
run's warm-up steps. Runs of one setting (repetitions: they differ only in their folder)
make one row: the measured mean with its spread, predicted from their answer lengths
pooled (`bench/sim_validation.py` makes the validation runs, repeated).

Devices are cores. Asynchronous: the rollout server holds its `rollout.torch_threads`
cores, the trainer the rest (its thread count). Synchronous (eta 0, drain): one server
and then the trainer take turns on all the trainer's cores; the server decodes on its
own thread count whatever the number of devices it is given, as it does in the run.
Not simulated: grading (a Dask worker process), the controller, the HTTP calls and the
trainer's work around `Trainer.step` (staging weights, metrics); they share the cores.
Where the calibration file holds an in-situ fit (`areal_core.sim.in_situ`, from runs of
the whole system in another setting), a second prediction scales the component costs by
what those runs measured the system to add; `--components-only` leaves it out.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from areal_core.rollout.backend import WeightUpdateMode
from areal_core.sim.cost import CostModel, in_situ_cost
from areal_core.sim.engine import SimConfig, simulate
from areal_core.sim.hardware import GPUSpec, ModelSpec
from areal_core.sim.lengths import LengthDist

# The tiny model and a core of this machine, as the simulator's specs: only their memory
# checks run when a calibrated cost model is given, and neither binds.
TINY = ModelSpec(
    "tiny (quickstart)", params=0.5e6, layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, bytes_per_param=4
)
CPU_CORE = GPUSpec("CPU core", peak_flops=1e11, hbm_bandwidth=1e10, memory_bytes=8e9, nvlink_bandwidth=1e10)


@dataclass(frozen=True)
class RunFacts:
    """What a measured run gives the simulator, and what it measured."""

    run_dir: str
    name: str
    eta: int
    weight_update: WeightUpdateMode
    prompts_per_step: int
    answers_per_prompt: int
    steps: int
    warmup_steps: int
    max_new_tokens: int
    prompt_tokens: int
    answer_lengths: tuple[int, ...]
    n_servers: int
    rollout_threads: int
    trainer_threads: int
    max_running: int
    measured_tokens_per_s: float

    @property
    def mode(self) -> str:
        return "sync" if self.eta == 0 and self.weight_update == "drain" else "async"


def _prompt_lengths(cfg) -> dict[str, int]:
    """Prompt id -> token count, as the run encoded its prompts (cached: the in-situ fit
    reads several runs of one data set)."""
    return _prompt_lengths_of(cfg.model.name, cfg.data.model_dump_json())


@functools.lru_cache(maxsize=4)
def _prompt_lengths_of(model_name: str, data_json: str) -> dict[str, int]:
    from areal_core.data.config import DataConfig
    from areal_core.data.datasets import load_records
    from areal_core.data.prompting import encode_prompt

    if model_name == "tiny":
        from areal_core.models import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:  # a saved character tokenizer loads as saved (AutoTokenizer would drop its spaces)
        from areal_core.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_name)
    train, _ = load_records(DataConfig.model_validate_json(data_json))
    return {r.id: len(encode_prompt(tokenizer, r)) for r in train}


def read_run(run_dir: str | os.PathLike) -> RunFacts:
    import pandas as pd

    from areal_core.experiment import parse_config

    run = Path(run_dir)
    for name in ("config.json", "summary.json", "ledger.parquet"):
        if not (run / name).is_file():
            raise ValueError(f"{run}: no {name} (not a finished run folder)")
    cfg = parse_config(json.loads((run / "config.json").read_text()), source=str(run / "config.json"))
    summary = json.loads((run / "summary.json").read_text())
    ledger = pd.read_parquet(run / "ledger.parquet")
    prompt_ids = ledger["trajectory_id"].str.extract(r"^e\d+-p(.+)-s\d+$")[0]
    lengths = _prompt_lengths(cfg)
    prompt_tokens = round(float(np.mean([lengths[p] for p in prompt_ids])))
    n = cfg.rollout.n_samples
    return RunFacts(
        run_dir=str(run),
        name=cfg.name,
        eta=cfg.trainer.eta,
        weight_update=cfg.rollout.weight_update,
        prompts_per_step=cfg.trainer.batch_size // n,
        answers_per_prompt=n,
        steps=int(summary["steps"]),
        warmup_steps=cfg.trainer.warmup_steps_for_throughput,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        prompt_tokens=prompt_tokens,
        answer_lengths=tuple(int(x) for x in ledger["n_tokens"]),
        n_servers=cfg.rollout.n_servers,
        rollout_threads=cfg.rollout.torch_threads,
        trainer_threads=int(summary["trainer_torch_threads"]),
        max_running=cfg.rollout.max_running,
        measured_tokens_per_s=float(summary["effective_train_tokens_per_s"]),
    )


def sim_config(facts: RunFacts, cost: CostModel, seed: int = 0) -> SimConfig:
    """The run's setting as the simulator's, devices being cores (see the module docstring)."""
    if facts.mode == "sync":
        n_gpus, n_rollout, tp = facts.trainer_threads * facts.n_servers, None, facts.trainer_threads
    else:
        tp = facts.rollout_threads
        n_rollout = facts.n_servers * tp
        n_gpus = n_rollout + facts.trainer_threads
    return SimConfig(
        model=TINY,
        gpu=CPU_CORE,
        n_gpus=n_gpus,
        mode=facts.mode,
        n_rollout_gpus=n_rollout,
        rollout_tp=tp,
        eta=facts.eta,
        weight_update=facts.weight_update,
        prompts_per_step=facts.prompts_per_step,
        answers_per_prompt=facts.answers_per_prompt,
        prompt_tokens=facts.prompt_tokens,
        lengths=LengthDist.empirical(facts.answer_lengths, facts.max_new_tokens),
        n_steps=facts.steps,
        warmup_steps=facts.warmup_steps,
        seed=seed,
        cost=cost,
        max_running_per_server=facts.max_running,
        admit_reserve_tokens=0,
        train_shared_prompt=True,
    )


def predict(facts: RunFacts, cost: CostModel, seeds: int = 3) -> dict:
    """Simulated answer tokens/s (mean and spread over `seeds` draws of the lengths)."""
    results = [simulate(sim_config(facts, cost, seed)) for seed in range(seeds)]
    values = np.array([r.effective_answer_throughput for r in results])
    return {
        "simulated": float(values.mean()),
        "simulated_std": float(values.std()),
        "rollout_util": float(np.mean([r.rollout_util for r in results])),
        "trainer_util": float(np.mean([r.trainer_util for r in results])),
        "staleness_mean": float(np.mean([r.staleness_mean for r in results])),
    }


def _setting_key(f: RunFacts) -> tuple:
    """What makes two runs repetitions of one setting: everything but the folder, the
    answers drawn and the figure measured."""
    return (
        f.name,
        f.mode,
        f.eta,
        f.weight_update,
        f.prompts_per_step,
        f.answers_per_prompt,
        f.steps,
        f.warmup_steps,
        f.max_new_tokens,
        f.prompt_tokens,
        f.n_servers,
        f.rollout_threads,
        f.trainer_threads,
        f.max_running,
    )


def group_repetitions(facts: list[RunFacts]) -> list[list[RunFacts]]:
    """Runs of one setting together (repetitions), in the order first seen."""
    groups: dict[tuple, list[RunFacts]] = {}
    for f in facts:
        groups.setdefault(_setting_key(f), []).append(f)
    return list(groups.values())


def validate_runs(run_dirs: list[str], cost: CostModel, seeds: int = 3, in_situ: dict | None = None) -> list[dict]:
    """One row per setting: repetitions of a setting (runs that differ only in their folder)
    are one row, measured as their mean (with the spread), predicted from their answer
    lengths pooled. The prediction from the components' costs alone and, given an in-situ
    calibration (`areal_core.sim.in_situ`), the one with the system's overheads; each
    error is against the mean, and against each repetition (`*_rel_error_range`)."""
    rows = []
    for group in group_repetitions([read_run(d) for d in run_dirs]):
        measured = np.array([f.measured_tokens_per_s for f in group])
        facts = replace(
            group[0],
            run_dir=", ".join(f.run_dir for f in group),
            answer_lengths=tuple(x for f in group for x in f.answer_lengths),
            measured_tokens_per_s=float(measured.mean()),
        )

        # against the mean, and the range against each repetition
        def errors(simulated: float, facts=facts, measured=measured) -> dict:
            return {
                "rel_error": simulated / facts.measured_tokens_per_s - 1,
                "rel_error_range": [float(simulated / measured.max() - 1), float(simulated / measured.min() - 1)],
            }

        p = predict(facts, cost, seeds)
        row = {
            "run": facts.name,
            "run_dir": facts.run_dir,
            "mode": facts.mode,
            "eta": facts.eta,
            "steps": facts.steps,
            "batch": f"{facts.prompts_per_step} x {facts.answers_per_prompt}",
            "answer_len_mean": float(np.mean(facts.answer_lengths)),
            "prompt_tokens": facts.prompt_tokens,
            "measured": facts.measured_tokens_per_s,
            "measured_runs": measured.tolist(),
            "measured_std": float(measured.std(ddof=1)) if len(measured) > 1 else 0.0,
            **p,
            **errors(p["simulated"]),
        }
        if in_situ:
            q = predict(facts, in_situ_cost(cost, in_situ, facts.mode), seeds)
            row.update({f"in_situ_{k}": v for k, v in {**q, **errors(q["simulated"])}.items()})
        rows.append(row)
    return rows


def _error(r: dict, prefix: str) -> str:
    lo, hi = r[prefix + "rel_error_range"]
    return f"{r[prefix + 'rel_error']:+.1%}" + (f" ({lo:+.0%}..{hi:+.0%})" if len(r["measured_runs"]) > 1 else "")


def format_rows(rows: list[dict]) -> str:
    """The validation table; with repetitions, the measured column is mean ± sd (n) and each
    error is against the mean, with its range over the repetitions in brackets."""
    in_situ = all("in_situ_simulated" in r for r in rows)
    head = "| run | mode | steps | batch | answer mean | measured tok/s | components alone, tok/s | error |"
    lines = [
        head + (" with in-situ overheads, tok/s | error |" if in_situ else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if in_situ else ""),
    ]
    for r in rows:
        mode = r["mode"] + (f", eta {r['eta']}" if r["mode"] == "async" else "")
        n = len(r["measured_runs"])
        measured = f"{r['measured']:,.0f}" + (f" ± {r['measured_std']:,.0f} ({n})" if n > 1 else "")
        line = (
            f"| {r['run']} | {mode} | {r['steps']} | {r['batch']} | {r['answer_len_mean']:.1f} "
            f"| {measured} | {r['simulated']:,.0f} ± {r['simulated_std']:,.0f} | {_error(r, '')} |"
        )
        if in_situ:
            line += f" {r['in_situ_simulated']:,.0f} ± {r['in_situ_simulated_std']:,.0f} | {_error(r, 'in_situ_')} |"
        lines.append(line)
    return "\n".join(lines)


def calibration_notes(in_situ: dict | None, run_dirs: list[str]) -> list[str]:
    """What the rows' in-situ prediction rests on: the runs it was fitted on, and a warning for
    any of ``run_dirs`` among them (a run that is its own calibration)."""
    if not in_situ:
        return []
    notes = ["in-situ overheads fitted on: " + ", ".join(r["run_dir"] for r in in_situ["runs"])]
    fitted = {str(Path(r["run_dir"]).resolve()) for r in in_situ["runs"]}
    overlap = fitted & {str(Path(r).resolve()) for r in run_dirs}
    if overlap:
        notes.append(f"WARNING: these runs are their own calibration: {', '.join(sorted(overlap))}")
    return notes
