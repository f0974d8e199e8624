"""The benchmarks ``evaluate_checkpoint`` and ``areal-flow eval`` know, and how to prompt for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from areal_core.data.records import Record
from areal_core.data.sources import MATH_INSTRUCTION, read_source


@dataclass(frozen=True)
class Benchmark:
    name: str
    label: str  # how reports name it
    task: str  # "math", "code" or "chain"
    load: Callable[[], list[Record]]
    instruction: str | None  # appended to the prompt on a new line (code prompts carry their own)


def _synthetic() -> list[Record]:
    from areal_core.data.config import SyntheticTask
    from areal_core.data.synthetic import ChainTask

    return ChainTask(SyntheticTask()).eval_records()


def _source(name: str) -> Callable[[], list[Record]]:
    return lambda: read_source(name)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "AIME 2024", "math", _source("aime24"), MATH_INSTRUCTION),
        Benchmark("aime25", "AIME 2025", "math", _source("aime25"), MATH_INSTRUCTION),
        Benchmark("math500", "MATH-500", "math", _source("math500"), MATH_INSTRUCTION),
        Benchmark("gsm8k", "GSM8K test", "math", _source("gsm8k"), MATH_INSTRUCTION),
        Benchmark(
            "livecodebench",
            "LiveCodeBench v5 2024-08..2025-01 (public tests only)",
            "code",
            _source("livecodebench"),
            None,
        ),
        Benchmark("humaneval", "HumanEval", "code", _source("humaneval"), None),
        Benchmark("leetcode", "LeetCodeDataset test", "code", _source("leetcode"), None),
        Benchmark("synthetic", "synthetic chain task, held-out split (default task config)", "chain", _synthetic, None),
    )
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def load_benchmark(name: str, limit: int | None = None) -> list[Record]:
    """The benchmark's problems (the first ``limit`` of them, in file order)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    records = get_benchmark(name).load()
    return records[:limit] if limit else records


def reference_text(record: Record) -> str:
    """What the grader compares against: the answer (math), the whole chain (chain); code uses tests."""
    if record.task == "chain":
        return record.solution or ""
    return record.answer


def reference_response(record: Record) -> str | None:
    """A response built from the record's own reference solution (for the self-check), or None."""
    if record.task == "math":
        if record.solution and record.source == "gsm8k":
            return record.solution  # ends in "#### N"
        if record.solution and "\\boxed" in record.solution:
            return record.solution
        return f"The final answer is $\\boxed{{{record.answer}}}$."  # no worked solution in the data
    if record.task == "code":
        return f"```python\n{record.solution}\n```" if record.solution else None
    return record.solution
