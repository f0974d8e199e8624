"""Synthetic reasoning task: the running sum of a chain of one-digit numbers.

Prompt: labelled digits then "=", e.g. ``a3b5c7=``. Correct response, in the
default ``explicit`` format: each step writes its label, the digit it adds and
the new running total, then "|" and the final answer, e.g. ``a3=3,b5=8,c7=15|15``.
The ``compact`` format writes only the running totals, ``a3b8c15|15``; it is
harder for a small model (each step must look the digit up in the prompt
without writing it down). The ``tool`` format (for the tool-use episode,
``episode: {kind: tool}``) writes chains of ``tool_min_chain`` steps or more as
a Python call that sums the prompt's digits, the sandbox's output and the answer,
``<py>sum(map(int,'a3b5c7d2e9f1'[1::2]))</py><out>27</out>|27`` (the ``<out>`` part
is what the environment adds), and shorter ones as ``explicit``. The tokenizer's EOS follows the
answer. The chain length k is drawn from [min_chain, max_chain] with P(k) proportional
to 1/k**alpha, which gives a heavy-tailed distribution of response lengths.

Held-out split: a fixed share of the prompt space (chosen by a seeded hash of
the prompt) is reserved for evaluation. Train draws reject reserved prompts,
eval draws accept only reserved ones, so no eval prompt appears in the train
split, both splits follow the same chain-length distribution, and the split
does not depend on n_train or n_eval. Draws are i.i.d. within a split (short
chains have few distinct prompts, e.g. 100 for k=2, so they repeat).
"""

from __future__ import annotations

import hashlib
import random
import re
import string

from areal_core.data.config import SyntheticTask
from areal_core.data.records import Record

LABELS = string.ascii_lowercase
EVAL_SHARE_PER_MILLE = 200  # share of the prompt space reserved for eval
_ENUMERATE_UP_TO = 3  # chain lengths with at most 10**3 prompts: draw from the enumerated share
_INT = re.compile(r"[+-]?\d+")
_PROMPT = re.compile(r"(?:[a-z]\d)+=")


def chain_length_probs(min_chain: int, max_chain: int, alpha: float) -> dict[int, float]:
    """P(k) proportional to 1/k**alpha for k in [min_chain, max_chain]."""
    weights = {k: 1.0 / k**alpha for k in range(min_chain, max_chain + 1)}
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


def make_prompt(digits: list[int]) -> str:
    if not 1 <= len(digits) <= len(LABELS):
        raise ValueError(f"chain length must be 1..{len(LABELS)}, got {len(digits)}")
    return "".join(f"{LABELS[i]}{d}" for i, d in enumerate(digits)) + "="


FORMATS = ("explicit", "compact", "tool")
# The tool format's transcript: a Python call between TOOL_OPEN and TOOL_CLOSE, then the sandbox's
# output as TOOL_RESULT (environment text: areal_core.episodes.tool appends it), then "|" and the answer
TOOL_OPEN, TOOL_CLOSE, TOOL_RESULT = "<py>", "</py>", "<out>{output}</out>"


def make_tool_call(digits: list[int]) -> str:
    """The call of a tool transcript, between the tags: Python that sums the digits of the prompt,
    which it quotes whole (copying text is what a small model does well; adding is not)."""
    return f"{TOOL_OPEN}sum(map(int,'{make_prompt(digits)[:-1]}'[1::2])){TOOL_CLOSE}"


def make_solution(digits: list[int], fmt: str = "explicit", tool_min_chain: int | None = None) -> str:
    """The correct response: the chain of running totals, then '|' and the total. ``tool``: a chain
    of ``tool_min_chain`` steps or more is a Python call, its output and '|' and the total instead."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown chain format {fmt!r}; expected one of {FORMATS}")
    if fmt == "tool":
        if tool_min_chain is None:
            raise ValueError("the tool format needs tool_min_chain (the shortest chain that uses the tool)")
        if len(digits) >= tool_min_chain:
            total = sum(digits)
            return f"{make_tool_call(digits)}{TOOL_RESULT.format(output=repr(total))}|{total}"
        fmt = "explicit"
    total = 0
    parts = []
    for i, d in enumerate(digits):
        total += d
        parts.append(f"{LABELS[i]}{d}={total}" if fmt == "explicit" else f"{LABELS[i]}{total}")
    return ("," if fmt == "explicit" else "").join(parts) + f"|{total}"


def prompt_digits(prompt: str) -> list[int]:
    """Inverse of :func:`make_prompt` (raises ValueError on a malformed prompt)."""
    if not _PROMPT.fullmatch(prompt):
        raise ValueError(f"not a chain prompt: {prompt!r}")
    return [int(prompt[i + 1]) for i in range(0, len(prompt) - 1, 2)]


def solve_chain(prompt: str, fmt: str = "explicit", tool_min_chain: int | None = None) -> str:
    return make_solution(prompt_digits(prompt), fmt, tool_min_chain)


def parse_chain_answer(response: str) -> str | None:
    """The final answer of a response: the integer after the last '|', or None."""
    if "|" not in response:
        return None
    tail = response.rsplit("|", 1)[1].strip()
    return tail if _INT.fullmatch(tail) else None


def check_chain(response: str, answer: str) -> bool:
    """True iff the text after the last '|' (stripped) is the integer ``answer``."""
    got = parse_chain_answer(response)
    want = answer.strip()
    if got is None or not _INT.fullmatch(want):
        return False
    return int(got) == int(want)


def grade_chain(response: str, solution: str) -> tuple[bool, str | None, str]:
    """Strict grading of a chain response against the correct solution.

    Correct means the whole chain is right: every labelled running total and the
    final answer. A right final number reached through a wrong chain is graded
    wrong ("wrong chain"): rewarding it lets a policy drift towards guessing the
    final number and abandon the chain, which is what the task exists to need.
    Returns (correct, parsed final answer, reason).
    """
    got = parse_chain_answer(response)
    want = parse_chain_answer(solution)
    if got is None:
        return False, None, "no answer found"
    if want is None or not _INT.fullmatch(got) or int(got) != int(want):
        return False, got, "wrong final answer"
    if response.strip() != solution.strip():
        return False, got, "wrong chain"
    return True, got, "ok"


def is_eval_prompt(prompt: str, seed: int) -> bool:
    """Whether ``prompt`` belongs to the held-out share of the prompt space."""
    h = hashlib.blake2b(f"{seed}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % 1000 < EVAL_SHARE_PER_MILLE


class ChainTask:
    """Deterministic train/eval record sets for the chain task, given the config."""

    name = "chain"

    def __init__(self, cfg: SyntheticTask):
        self.cfg = cfg
        self.probs = chain_length_probs(cfg.min_chain, cfg.max_chain, cfg.alpha)
        self._ks = list(self.probs)
        self._ws = [self.probs[k] for k in self._ks]
        self._train: list[Record] | None = None
        self._eval: list[Record] | None = None
        self._pools: dict[tuple[int, bool], list[list[int]]] = {}

    def sample_lengths(self, n: int, rng: random.Random) -> list[int]:
        return rng.choices(self._ks, weights=self._ws, k=n)

    def _pool(self, k: int, want_eval: bool) -> list[list[int]]:
        """All digit chains of length k in the wanted share (small k only)."""
        key = (k, want_eval)
        if key not in self._pools:
            chains = ([int(c) for c in f"{n:0{k}d}"] for n in range(10**k))
            pool = [d for d in chains if is_eval_prompt(make_prompt(d), self.cfg.seed) == want_eval]
            if not pool:
                split = "eval" if want_eval else "train"
                raise ValueError(f"chain length {k}: no prompt falls in the {split} share for seed {self.cfg.seed}")
            self._pools[key] = pool
        return self._pools[key]

    def _draw(self, rng: random.Random, k: int, want_eval: bool) -> list[int]:
        if k <= _ENUMERATE_UP_TO:
            return list(rng.choice(self._pool(k, want_eval)))
        # Rejection sampling within the chain length keeps P(k) intact.
        while True:
            digits = [rng.randrange(10) for _ in range(k)]
            if is_eval_prompt(make_prompt(digits), self.cfg.seed) == want_eval:
                return digits

    def _records(self, split: str, n: int) -> list[Record]:
        rng = random.Random(f"chain-{split}-{self.cfg.seed}")
        want_eval = split == "eval"
        out = []
        for i in range(n):  # one draw at a time: a bigger split extends a smaller one
            k = self.sample_lengths(1, rng)[0]
            digits = self._draw(rng, k, want_eval)
            solution = make_solution(digits, self.cfg.format, self.cfg.tool_min_chain)
            out.append(
                Record(
                    id=f"chain-{split}-{i:06d}",
                    task="chain",
                    prompt=make_prompt(digits),
                    answer=str(sum(digits)),
                    solution=solution,
                    source=f"synthetic:chain:seed={self.cfg.seed}",
                    meta={"k": k},
                )
            )
        return out

    def train_records(self) -> list[Record]:
        if self._train is None:
            self._train = self._records("train", self.cfg.n_train)
        return list(self._train)

    def eval_records(self) -> list[Record]:
        if self._eval is None:
            self._eval = self._records("eval", self.cfg.n_eval)
        return list(self._eval)
