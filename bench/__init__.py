"""Benchmarks: the AReaL paper's system ablations and the peer engines, measured side by side.

    python -m bench all [--quick]      # every benchmark, then bench/results/summary.json
    python -m bench NAME [--quick]     # one of BENCHMARKS

Benchmarks are not tests: they print tables and write JSON, and assert nothing about time.
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
)
