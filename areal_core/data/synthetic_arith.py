"""Synthetic arithmetic in plain English, for a small pretrained chat model (SmolLM2-135M-Instruct).

A generator, not a public data set: each record is one question of four kinds (the records'
``meta["op"]``), followed by the same instruction:

    add   What is 47 plus 38?
    sub   What is 83 minus 29?
    mul   What is 7 times 16?
    word  Mia has 12 stickers. Mia gets 9 more stickers. How many stickers does Mia have now?
          (or: ... gives away 9 stickers. How many stickers does Mia have left?)

    Write the calculation, then 'The answer is' and the number.

The answer is the number, graded by the math grader (``reward/math.py`` reads "The answer is N").
SmolLM2-135M-Instruct answers about a quarter of these right out of the box, greedy: the kinds
differ (times tables are easiest), and much of what it gets wrong is the form, not the sum (it
writes ``44 + 24 = 68`` and stops, or explains the order of operations until it runs out of
tokens); its measured held-out start is in bench/results/smollm2_seeds.json (docs/RESULTS.md).

Held-out split: a fixed share of the calculations, chosen by a seeded hash of the calculation itself,
is reserved for evaluation; train draws reject reserved calculations and held-out draws accept only
them, so no held-out calculation is ever trained on, in any wording or order: a sum or a product is
one calculation whichever operand comes first (``47 plus 38`` and ``38 plus 47``, ``7 times 16`` and
``16 times 7``), and a word problem is the sum or difference it asks for (``Mia has 38 ... gets 47
more`` is ``38 plus 47``).
"""

from __future__ import annotations

import hashlib
import random

from areal_core.data.config import SyntheticArithTask
from areal_core.data.records import Record

INSTRUCTION = "Write the calculation, then 'The answer is' and the number."
EVAL_SHARE_PER_MILLE = 200  # share of the (kind, operands) reserved for evaluation
NAMES = ("Mia", "Tom", "Ana", "Lee", "Sam", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "books", "coins", "stickers", "marbles", "pencils", "cards", "shells")


def _operands(op: str, rng: random.Random, cfg: SyntheticArithTask) -> tuple[int, int]:
    if op == "mul":
        return rng.randint(2, cfg.max_factor), rng.randint(2, cfg.max_multiplicand)
    if op == "word":
        return rng.randint(2, cfg.max_word), rng.randint(2, cfg.max_word)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return (max(a, b), min(a, b)) if op == "sub" else (a, b)


def question(op: str, a: int, b: int, rng: random.Random) -> tuple[str, int]:
    """The question's text and its answer; ``rng`` picks the story of a word problem."""
    if op == "add":
        return f"What is {a} plus {b}?", a + b
    if op == "sub":
        return f"What is {a} minus {b}?", a - b
    if op == "mul":
        return f"What is {a} times {b}?", a * b
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    if a > b and rng.random() < 0.5:
        return (
            f"{name} has {a} {items}. {name} gives away {b} {items}. How many {items} does {name} have left?"
        ), a - b
    return (f"{name} has {a} {items}. {name} gets {b} more {items}. How many {items} does {name} have now?"), a + b


def calculation(op: str, a: int, b: int, answer: int) -> tuple[str, int, int]:
    """The calculation a question asks for, in one form whatever its wording or operand order: a sum
    or product with its operands sorted, a difference as it is (a word problem: its sum or difference)."""
    if op == "mul":
        return ("*", min(a, b), max(a, b))
    if op == "sub" or (op == "word" and answer == a - b):
        return ("-", a, b)
    return ("+", min(a, b), max(a, b))


def is_eval_problem(calc: tuple[str, int, int], seed: int) -> bool:
    """Whether a :func:`calculation` belongs to the held-out share."""
    sign, a, b = calc
    h = hashlib.blake2b(f"{seed}:arith:{sign}:{a}:{b}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % 1000 < EVAL_SHARE_PER_MILLE


class ArithTask:
    """Deterministic train/held-out record sets of the arithmetic task, given the config."""

    name = "arith"

    def __init__(self, cfg: SyntheticArithTask):
        self.cfg = cfg

    def _records(self, split: str, n: int) -> list[Record]:
        rng = random.Random(f"arith-{split}-{self.cfg.seed}")
        want_eval = split == "eval"
        out = []
        for i in range(n):
            op = rng.choice(self.cfg.ops)
            while True:  # rejection within the kind keeps the kinds' mix intact
                a, b = _operands(op, rng, self.cfg)
                text, answer = question(op, a, b, rng)
                if is_eval_problem(calculation(op, a, b, answer), self.cfg.seed) == want_eval:
                    break
            out.append(
                Record(
                    id=f"arith-{split}-{i:06d}",
                    task="math",
                    prompt=f"{text}\n{INSTRUCTION}",
                    answer=str(answer),
                    source=f"synthetic:arith:seed={self.cfg.seed}",
                    meta={"op": op, "a": a, "b": b},
                )
            )
        return out

    def train_records(self) -> list[Record]:
        return self._records("train", self.cfg.n_train)

    def eval_records(self) -> list[Record]:
        return self._records("eval", self.cfg.n_eval)
