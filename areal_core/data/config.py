from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from areal_core.configbase import Section


class SyntheticTask(Section):
    """Chain-of-running-sums task; chain lengths drawn with P(k) proportional to 1/k**alpha."""

    kind: Literal["chain"] = "chain"
    n_train: int = Field(20000, gt=0)  # train records drawn (i.i.d.: short chains repeat)
    n_eval: int = Field(500, gt=0)  # held-out records drawn, from prompts no train record has
    min_chain: int = Field(2, ge=1)  # shortest chain (digits in a prompt)
    max_chain: int = Field(12, ge=1)  # longest chain, at most 26 (one letter label per step)
    alpha: float = Field(1.0, ge=0)  # P(chain length k) proportional to 1/k**alpha; 0: uniform
    seed: int = 0  # seeds the draws and which prompts are held out
    # explicit: a3=3,b5=8,c7=15|15 (each step writes the digit it adds); compact: a3b8c15|15;
    # tool (for episode kind tool): chains of tool_min_chain steps or more as a Python call that sums
    # the prompt's digits, the sandbox's output and the answer,
    # <py>sum(map(int,'a3b5c7d2'[1::2]))</py><out>17</out>|17; shorter ones explicit
    format: Literal["explicit", "compact", "tool"] = "explicit"
    tool_min_chain: int | None = Field(None, ge=1)  # format tool only (None elsewhere)

    @model_validator(mode="after")
    def _chain_order(self):
        if self.max_chain < self.min_chain:
            raise ValueError(f"max_chain ({self.max_chain}) must be >= min_chain ({self.min_chain})")
        if self.max_chain > 26:
            raise ValueError(f"max_chain ({self.max_chain}) must be <= 26 (one letter label per step)")
        if (self.format == "tool") != (self.tool_min_chain is not None):
            raise ValueError(
                "format: tool needs tool_min_chain (the shortest chain written as a tool call), "
                "and only format: tool takes it"
            )
        return self


class SyntheticCodeTask(Section):
    """Short Python functions from examples (areal_core.data.synthetic_code): a function linear in
    its k arguments, shown at zero and the unit points; the answer is ``def f(...): return ...``,
    graded by unit tests in the sandbox. k is drawn with P(k) proportional to 1/k**alpha."""

    kind: Literal["code"]
    n_train: int = Field(20000, gt=0)  # train records drawn
    n_eval: int = Field(500, gt=0)  # held-out records drawn, from functions no train record has
    max_args: int = Field(4, ge=1, le=4)  # k in [1, max_args] (arguments named x, y, z, w)
    alpha: float = Field(1.0, ge=0)  # P(k arguments) proportional to 1/k**alpha; 0: uniform
    max_coef: int = Field(9, ge=1)  # coefficients in [-max_coef, max_coef]
    max_const: int = Field(20, ge=0)  # the constant in [-max_const, max_const]
    seed: int = 0  # seeds the draws and which functions are held out


class SyntheticArithTask(Section):
    """Arithmetic questions in plain English for a small pretrained chat model
    (areal_core.data.synthetic_arith): two-digit sums and differences, times tables and one-step
    word problems, each ending in the same instruction; graded by the math grader."""

    kind: Literal["arith"]
    n_train: int = Field(20000, gt=0)  # train records drawn
    n_eval: int = Field(400, gt=0)  # held-out records drawn, from calculations no train record has
    # the kinds drawn (uniformly): add, sub (two-digit numbers), mul (a x b), word (one-step stories)
    ops: list[Literal["add", "sub", "mul", "word"]] = Field(["add", "sub", "mul", "word"], min_length=1)
    max_factor: int = Field(12, ge=2)  # mul: a in [2, max_factor]
    max_multiplicand: int = Field(19, ge=2)  # mul: b in [2, max_multiplicand]
    max_word: int = Field(30, ge=2)  # word: both numbers in [2, max_word]
    seed: int = 0  # seeds the draws and which calculations are held out


def _synthetic_kind(value) -> str:
    return value.get("kind", "chain") if isinstance(value, dict) else getattr(value, "kind", "chain")


# data.synthetic: the chain task (kind: chain, the default when no kind is given), the code task
# (kind: code) or the arithmetic task (kind: arith)
SyntheticConfig = Annotated[
    Annotated[SyntheticTask, Tag("chain")]
    | Annotated[SyntheticCodeTask, Tag("code")]
    | Annotated[SyntheticArithTask, Tag("arith")],
    Discriminator(_synthetic_kind),
]


class Curriculum(Section):
    """Adaptive prompt mix for RL (areal_core.controller.prompt_sampling.BucketCurriculum): prompts are
    grouped by a meta field of their records, and a group is drawn with weight
    share * max(p * (1 - p), floor), p its running pass rate."""

    by: str = Field(min_length=1)  # the records' meta field, e.g. "k" (chain length) or "level" (MATH)
    ema: float = Field(0.2, gt=0, le=1)  # weight of each finished group in the running pass rate
    floor: float = Field(0.02, ge=0, le=0.25)  # lowest p(1-p) weight, so no bucket is dropped for good


class DataConfig(Section):
    """The problems: the train records RL draws prompts from, and the held-out ones it is evaluated on."""

    # `synthetic` or a path/URL to a records file (jsonl or parquet, the project's record schema)
    dataset: str = "synthetic"
    # held-out problems, a records file like data.dataset; None: the synthetic task's held-out split (a
    # data.dataset file needs one given here)
    eval_dataset: str | None = None
    synthetic: SyntheticConfig = SyntheticTask()  # the task that makes the records of dataset `synthetic`
    # a fresh seeded order of the train prompts every epoch; false: their order in the data set (either
    # way unused with a curriculum)
    shuffle: bool = True
    curriculum: Curriculum | None = None  # None: the data set's own mix, in shuffled epochs
