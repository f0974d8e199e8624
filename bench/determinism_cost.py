"""What runs that repeat cost the quickstart, measured side by side on this machine.

Two defaults keep a run's arithmetic and its trajectories from following the machine's timing:

1. **Core lending only where the trainer's arithmetic does not depend on its thread count**
   (``trainer.lend_idle_cores`` None: on for bfloat16, or float32 on an Intel CPU; off for float32 on
   other CPUs, where MKL's products follow the thread count). The quickstart's tiny model computes in
   float32, so on an AMD CPU its asynchronous run no longer borrows the servers' idle cores. Measured:
   the asynchronous quickstart (eta 4, 40 steps) as default against ``trainer.lend_idle_cores=true``.
2. **Synchronous runs deterministic** (``rollout.deterministic`` and ``rollout.batch_invariant`` None:
   on at eta 0): the batch-invariant engine, the curriculum fed in admission order. Measured: the
   synchronous quickstart (eta 0, drain, 40 steps) as default against both set false.

Each pair runs one after the other, the order alternating pair by pair; the ratio of effective training
tokens/s (the run's own figure, warm-up steps left out) is taken within each pair. The warm start is
cached (the first run trains it; it is not timed).

--quick: 1 pair of 12-step runs: a smoke check.
"""

from __future__ import annotations

from bench.common import format_table, median, spread
from bench.learning import runs_root, say, train

BASE = ("trainer.max_steps=40",)
COMPARISONS = {
    # label: (config overrides of the default run, of the run as before)
    "async quickstart: lending off (default) / on": ((), ("trainer.lend_idle_cores=true",)),
    "sync quickstart: deterministic (default) / not": (
        ("trainer.eta=0", "rollout.weight_update=drain"),
        (
            "trainer.eta=0",
            "rollout.weight_update=drain",
            "rollout.deterministic=false",
            "rollout.batch_invariant=false",
        ),
    ),
}


def _pairs(root, label: str, default: tuple, before: tuple, pairs: int, steps: tuple) -> dict:
    rows = {"default": [], "before": []}
    for k in range(pairs):
        order = ("default", "before") if k % 2 == 0 else ("before", "default")
        for which in order:
            sets = (*steps, *(default if which == "default" else before))
            slug = label.split(":")[0].replace(" ", "-")
            rows[which].append(train(f"{slug}-{which}-{k}", 0, sets, root))
    ratios = [d["tokens_per_s"] / b["tokens_per_s"] for d, b in zip(rows["default"], rows["before"])]
    return {
        "default_tokens_per_s": [r["tokens_per_s"] for r in rows["default"]],
        "before_tokens_per_s": [r["tokens_per_s"] for r in rows["before"]],
        "default_after": [r["after"] for r in rows["default"]],
        "before_after": [r["after"] for r in rows["before"]],
        "ratio": spread(ratios),
    }


def run(quick: bool) -> dict:
    root = runs_root("determinism_cost" + ("_quick" if quick else ""))
    pairs, steps = (1, ("trainer.max_steps=12",)) if quick else (3, BASE)
    train("warm", 0, ("trainer.max_steps=1",), root)  # the warm start, cached for every run after it
    out = {}
    for label, (default, before) in COMPARISONS.items():
        say(label)
        out[label] = _pairs(root, label, default, before, pairs, steps)
    print(
        format_table(
            ["comparison", "default tokens/s", "before tokens/s", "default / before (median, min-max)"],
            [
                (
                    label,
                    median(r["default_tokens_per_s"]),
                    median(r["before_tokens_per_s"]),
                    f"{r['ratio']['median']:.3f} ({r['ratio']['min']:.3f}-{r['ratio']['max']:.3f})",
                )
                for label, r in out.items()
            ],
            title=f"What repeatable defaults cost the quickstart ({pairs} alternating pairs, {steps[0]})",
        )
    )
    return {
        "pairs": pairs,
        "comparisons": out,
        "summary": {
            "lending_off_over_on": out[next(iter(COMPARISONS))]["ratio"]["median"],
            "sync_deterministic_over_not": out[list(COMPARISONS)[1]]["ratio"]["median"],
        },
    }
