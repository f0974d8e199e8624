"""A TRL-peer workload for the benchmarks' unit tests: the tiny model's settings, any field changed."""

from __future__ import annotations

from bench import trl_peer_inputs as inputs


def workload(**kw) -> inputs.Workload:
    base = dict(
        name="tiny",
        model="/m",
        records="/r.jsonl",
        eval_records="/e.jsonl",
        prompts_per_step=8,
        answers_per_prompt=4,
        max_new_tokens=64,
        temperature=1.0,
        lr=1e-4,
        dtype="float32",
        chat=False,
        steps=30,
    )
    return inputs.Workload(**{**base, **kw})
