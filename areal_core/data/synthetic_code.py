"""Synthetic code task: write a short Python function from examples, graded by unit tests.

The function is linear in its k arguments, ``f(x, y) = 3*x - 2*y + 5``, and the prompt gives
its value at zero and at each unit point, then a question mark:

    f(0,0)=5,f(1,0)=8,f(0,1)=3?

(No whitespace in prompts. Until commit 991b9a9 (2026-11-25) a saved character tokenizer loaded back through
``transformers.AutoTokenizer`` dropped spaces and newlines when it encoded; ``models.tokenizer.
load_tokenizer`` now loads it as saved, and the prompts stay as they were.)

The reference answer reads each coefficient off the examples as a difference, and Python
does the arithmetic:

    def f(x,y): return x*(8-5)+y*(3-5)+5

Any program that computes the function passes. Grading runs the answer in the sandbox
against functional unit tests (the code grader's format, ``fn_name: f``): the k + 1 shown
points and :data:`N_HIDDEN` hidden ones, so a table of the shown values fails.

The number of arguments k (1 to :data:`MAX_ARGS`, the records' ``meta["k"]``) is drawn with
P(k) proportional to 1/k**alpha: answers get longer and harder with k, as chains do in the
chain task. Held-out split: a fixed share of the functions (chosen by a seeded hash of the
coefficients) is reserved for evaluation; train draws reject reserved functions and
held-out draws accept only them, so no held-out function is trained on.
"""

from __future__ import annotations

import hashlib
import json
import random

from areal_core.data.config import SyntheticCodeTask
from areal_core.data.records import Record

ARGS = "xyzw"
MAX_ARGS = len(ARGS)
N_HIDDEN = 3  # hidden test points, coordinates in [-HIDDEN_RANGE, HIDDEN_RANGE]
HIDDEN_RANGE = 9
EVAL_SHARE_PER_MILLE = 200  # share of the functions reserved for evaluation


def _points(k: int) -> list[tuple[int, ...]]:
    """The shown points: zero, then each unit point."""
    return [tuple(0 for _ in range(k))] + [tuple(int(i == j) for i in range(k)) for j in range(k)]


def value(coefs: tuple[int, ...], const: int, point: tuple[int, ...]) -> int:
    return sum(c * p for c, p in zip(coefs, point)) + const


def make_prompt(coefs: tuple[int, ...], const: int) -> str:
    return ",".join(f"f({','.join(map(str, p))})={value(coefs, const, p)}" for p in _points(len(coefs))) + "?"


def make_solution(coefs: tuple[int, ...], const: int) -> str:
    terms = "".join(f"{a}*({c + const}-{const})+" for a, c in zip(ARGS, coefs))
    return f"def f({','.join(ARGS[: len(coefs)])}): return {terms}{const}"


def make_tests(coefs: tuple[int, ...], const: int, rng: random.Random) -> list[dict]:
    hidden = [tuple(rng.randint(-HIDDEN_RANGE, HIDDEN_RANGE) for _ in coefs) for _ in range(N_HIDDEN)]
    return [
        {
            "testtype": "functional",
            "input": "\n".join(map(str, p)),
            "output": json.dumps(value(coefs, const, p)),
            "fn_name": "f",
        }
        for p in _points(len(coefs)) + hidden
    ]


def is_eval_function(coefs: tuple[int, ...], const: int, seed: int) -> bool:
    """Whether the function belongs to the held-out share."""
    h = hashlib.blake2b(f"{seed}:fn:{coefs}:{const}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % 1000 < EVAL_SHARE_PER_MILLE


def arg_count_probs(max_args: int, alpha: float) -> dict[int, float]:
    """P(k) proportional to 1/k**alpha for k in [1, max_args]."""
    weights = {k: 1.0 / k**alpha for k in range(1, max_args + 1)}
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


class FunctionTask:
    """Deterministic train/held-out record sets for the code task, given the config."""

    name = "code"

    def __init__(self, cfg: SyntheticCodeTask):
        self.cfg = cfg
        self.probs = arg_count_probs(cfg.max_args, cfg.alpha)

    def _draw(self, rng: random.Random, want_eval: bool) -> tuple[tuple[int, ...], int]:
        k = rng.choices(list(self.probs), weights=list(self.probs.values()))[0]
        while True:  # rejection within k keeps P(k) intact
            coefs = tuple(rng.randint(-self.cfg.max_coef, self.cfg.max_coef) for _ in range(k))
            const = rng.randint(-self.cfg.max_const, self.cfg.max_const)
            if is_eval_function(coefs, const, self.cfg.seed) == want_eval:
                return coefs, const

    def _records(self, split: str, n: int) -> list[Record]:
        rng = random.Random(f"fn-{split}-{self.cfg.seed}")
        out = []
        for i in range(n):
            coefs, const = self._draw(rng, split == "eval")
            out.append(
                Record(
                    id=f"fn-{split}-{i:06d}",
                    task="code",
                    prompt=make_prompt(coefs, const),
                    solution=make_solution(coefs, const),
                    tests=make_tests(coefs, const, rng),
                    source=f"synthetic:code:seed={self.cfg.seed}",
                    meta={"k": len(coefs), "coefs": list(coefs), "const": const},
                )
            )
        return out

    def train_records(self) -> list[Record]:
        return self._records("train", self.cfg.n_train)

    def eval_records(self) -> list[Record]:
        return self._records("eval", self.cfg.n_eval)
