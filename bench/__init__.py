"""Benchmarks: the AReaL paper's system ablations and the peer engines, measured side by side.

    python -m bench all [--quick]      # every benchmark, then bench/results/summary.json
    python -m bench NAME [--quick]     # one of BENCHMARKS, LEARNING or DIAGNOSTICS

``trl_peer``, ``trl_peer_smollm2`` and ``trl_peer_ab`` need TRL's own venv (bench/.venvs/trl): they
create it on first use, or run ``make bench-trl`` ahead of time.

LEARNING holds the learning measurements over seeds (each a series of full training
runs, an hour or so on 2 cores); DIAGNOSTICS, measurements that explain or check others (where
the cores go; the simulator against measured runs; the TRL peer on SmolLM2, an hour, and what
TRL's own settings cost; the engine-vs-trainer logprob gap of bf16 servers; how long `make demo`
takes, first and later; where the engine's decode step and the trainer's step go; long answers
by how the KV cache grows; how much one core's work slows the other's; what a rollout server's
process computes before it serves); `all` leaves both out.

Benchmarks are not tests: they print tables and write JSON, and assert nothing about time.
``python -m bench.render`` renders the docs' tables marked as coming from a record (bench/render.py).
"""

BENCHMARKS = (
    "dynamic_batching",
    "prox_approx",
    "engine",
    "weight_update",
    "interruptible",
    "rewards",
    "async_vs_sync",
    "checkpoints",
    "trl_peer",
    "kv_admission",
)

LEARNING = (
    "quickstart_seeds",
    "smollm2_seeds",
    "objective_ablation",
    "rl_vs_sft",
    "repeatability",
    "preemption",
    "preemption_slurm",
    "replay_speed",
    "dtype_control",
    "eta_until_clear",
    "learning_wallclock",
    "objective_campaign",
)

DIAGNOSTICS = (
    "core_split",
    "core_lending",
    "sim_validation",
    "trl_peer_smollm2",
    "trl_peer_ab",
    "determinism",
    "determinism_cost",
    "engine_mismatch",
    "demo",
    "decode_parts",
    "kv_growth",
    "core_interference",
    "server_start",
    "trainer_parts",
    "test_suite",
)
