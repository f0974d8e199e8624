"""TRL's ``GRPOTrainer`` as a peer on the tiny model: TRL vs areal-flow synchronous vs asynchronous.

    python -m bench trl_peer [--quick]     # creates bench/.venvs/trl on first use (~1-2 min, PyPI)
    make bench-trl                         # the same venv, ahead of time

All three train the same tiny random Qwen2 (0.5M parameters, hidden 128, 2 layers, the
project's character tokenizer), saved once as an HF folder that both sides load, on the same
512 arithmetic prompts (``Compute 3+4*2-5 =``, integer answers, written as an areal-flow records
file whose prompts and answers TRL reads too), with P prompts x G answers per step, up to T new
tokens at temperature 1, fp32, lr 1e-4, the same steps and 2 cores (``bench/trl_peer_inputs.py``
makes both sides' settings from one Workload):

* TRL 1.16.0 (pinned, its own venv ``bench/.venvs/trl``, gitignored; ``bench/trl_worker.py``
  runs there): fully on-policy ``GRPOTrainer`` (per_device_train_batch_size P*G,
  num_generations G, gradient_accumulation_steps 1, beta 0, use_vllm False), 2 torch threads,
  gradient checkpointing off (TRL's default is on; ``bench/trl_peer_ab.py`` measures it);
* areal-flow sync and async: ``run_experiment`` on ``areal_config`` (one rollout server
  with 1 thread; the trainer with the default split: both cores in sync, where generation is
  idle while it trains, the other core in async; grading in one Dask worker process).

Reward: +5 / -5 for an exact integer final answer on both sides (areal-flow's math grader;
TRL's reward function applies the same extraction rules); a random model scores ~0 anyway.

Full: both SETTINGS, STEPS_FULL steps, REPS_FULL repetitions interleaved (TRL, sync, async, TRL,
...): each system's effective train tokens/s per repetition with mean ± sd, min, max, and the
ratios per repetition (``bench/trl_peer_report.py``); about 30 min on 2 idle cores. --quick: the
first setting, STEPS_QUICK steps, one repetition: a smoke check, not a result.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.common import work_dir
from bench.trl_peer_inputs import CORES, WARMUP, prepare_tiny, tiny_workload
from bench.trl_peer_report import print_report, run_repetitions
from bench.trl_peer_systems import WORKER, ensure_venv
from bench.trl_peer_systems import run_areal as run_areal_workload

# (P prompts per step, G answers per prompt, T max new tokens)
SETTINGS = ((8, 4, 64), (16, 8, 128))
STEPS_FULL, STEPS_QUICK = 30, 6
REPS_FULL, REPS_QUICK = 3, 1


def prepare_inputs(root: Path) -> dict:
    """The tiny model's folder and prompts under ``root`` (see ``trl_peer_inputs.prepare_tiny``)."""
    return prepare_tiny(root)


def run_areal(mode: str, inputs: dict, P: int, G: int, T: int, steps: int, run_dir: Path, scheduler) -> dict:
    """One areal-flow run on the tiny model at (P, G, T), as this benchmark runs it."""
    return run_areal_workload(mode, tiny_workload(inputs, P, G, T, steps), run_dir, scheduler)


def run(quick: bool) -> dict:
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    root = work_dir("trl_peer", quick)
    ensure_venv(str(root / "trl-install.log"))
    inputs = prepare_inputs(root)
    steps, reps = (STEPS_QUICK, REPS_QUICK) if quick else (STEPS_FULL, REPS_FULL)
    settings = SETTINGS[:1] if quick else SETTINGS
    results = {}
    with RewardService(RewardConfig(n_workers=1)) as shared:  # one Dask cluster serves every areal-flow run
        for P, G, T in settings:
            w = tiny_workload(inputs, P, G, T, steps)
            results[w.tag()] = run_repetitions(w, reps, root, shared.client_settings())
            print_report(f"tiny {w.tag()}", results[w.tag()], quick)
    summary = {}
    for i, (tag, res) in enumerate(results.items()):
        suffix = "" if i == 0 else f"_{tag}"
        summary.update({f"trl_peer_{k}{suffix}": r["mean"] for k, r in res["ratios"].items()})
    return {
        "setup": {
            **inputs["about"],
            "steps": steps,
            "repetitions": reps,
            "warmup_steps_excluded": WARMUP,
            "cores": CORES,
            "settings": [{"P": P, "G": G, "max_new_tokens": T} for P, G, T in settings],
            "trl_worker": str(WORKER.relative_to(WORKER.parents[1])),
            "work_dir": str(root),
            "quick": quick,
            "note": "a smoke check, not a result" if quick else None,
        },
        "settings": results,
        "summary": summary,
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench trl_peer [--quick]")
