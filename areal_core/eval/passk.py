"""pass@k (the unbiased estimator of Chen et al., 2021) and majority vote maj@k."""

from __future__ import annotations

import re
from collections import Counter
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n with c correct, is correct.

    Unbiased estimator 1 - C(n-c, k) / C(n, k); exact (integer binomials).
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _vote_key(answer: str) -> str:
    return re.sub(r"\s+", "", answer)


def maj_at_k(answers: list[str | None], correct: list[bool], k: int) -> bool:
    """Is the most frequent parsed answer among the first k samples correct?

    Samples without an answer do not vote. Answers are compared as strings
    (whitespace removed); a tie goes to the answer seen first.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} verdicts")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k needs 1 <= k <= {len(answers)}, got {k}")
    votes: Counter[str] = Counter()
    first: dict[str, int] = {}
    for i in range(k):
        if answers[i] is None:
            continue
        key = _vote_key(answers[i])
        votes[key] += 1
        first.setdefault(key, i)
    if not votes:
        return False
    winner = max(votes, key=lambda a: (votes[a], -first[a]))
    return bool(correct[first[winner]])
