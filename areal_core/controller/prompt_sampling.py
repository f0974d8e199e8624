"""Which prompt the rollout controller admits next.

Two samplers with one interface (``next``, ``observe``, ``state``, ``estimates``, ``mix``):

* :class:`PromptStream`: the data set in a fresh seeded permutation each epoch;
* :class:`BucketCurriculum`: an adaptive mix. Prompts are grouped into buckets (a
  record's ``meta`` field, e.g. the chain length ``k`` of the synthetic task or the
  ``level`` of MATH). A bucket is drawn with weight

      share_b * max(p_b * (1 - p_b), floor)

  where share_b is the bucket's share of the data set and p_b the running pass rate of
  its answers (an exponential moving average over finished groups, 0.5 before any).
  p(1 - p) is the variance of a 0/1 reward: groups whose answers are all right or all
  wrong carry no signal once advantages are normalised per group, so the mix moves to
  the buckets the policy can partly solve. Within a bucket, prompts follow that
  bucket's own seeded permutations.

Both are deterministic given the seed and the sequence of ``observe`` calls, and both
restart exactly from ``state()`` (the resume state of a run).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class HasId(Protocol):
    id: str


def make_sampler(
    prompts: Sequence, shuffle: bool, seed: int, curriculum: dict | None = None, state: dict | None = None
):
    """A :class:`PromptStream`, or with ``curriculum`` ({"ema": .., "floor": ..}) a
    :class:`BucketCurriculum` over the prompts' ``bucket``; at ``state`` (a ``state()``) if given."""
    if curriculum is None:
        return PromptStream(prompts, shuffle, seed, state)
    missing = [p.id for p in prompts if p.bucket is None]
    if missing:
        raise ValueError(f"the curriculum needs a bucket for every prompt; {len(missing)} have none, e.g. {missing[0]}")
    return BucketCurriculum(prompts, [p.bucket for p in prompts], seed, state=state, **curriculum)


class _Permutations:
    """Items 0..n-1 in a fresh seeded order per epoch (the current epoch's order cached)."""

    def __init__(self, n: int, shuffle: bool, seed_of_epoch):
        self.n, self.shuffle, self.seed_of_epoch = n, shuffle, seed_of_epoch
        self._epoch, self._order = None, None

    def at(self, position: int) -> tuple[int, int]:
        """(epoch, item) at ``position`` of the endless stream."""
        epoch, offset = divmod(position, self.n)
        if not self.shuffle:
            return epoch, offset
        if epoch != self._epoch:
            self._order = list(range(self.n))
            random.Random(self.seed_of_epoch(epoch)).shuffle(self._order)
            self._epoch = epoch
        return epoch, self._order[offset]


class PromptStream:
    """Endless stream over ``prompts``: each epoch is a fresh permutation when shuffling."""

    def __init__(self, prompts: Sequence[HasId], shuffle: bool, seed: int, state: dict | None = None):
        if not prompts:
            raise ValueError("no prompts to draw from")
        self.prompts = prompts
        self._perm = _Permutations(len(prompts), shuffle, lambda epoch: seed * 1_000_003 + epoch)
        self.n_drawn = int(state["n_drawn"]) if state else 0

    def next(self) -> tuple[int, HasId]:
        """(epoch, prompt) of the next draw."""
        epoch, i = self._perm.at(self.n_drawn)
        self.n_drawn += 1
        return epoch, self.prompts[i]

    def observe(self, prompt_id: str, n_correct: int, n: int) -> None:
        """A finished group's result (this sampler does not adapt)."""

    def state(self) -> dict:
        return {"n_drawn": self.n_drawn}

    def estimates(self) -> dict[str, float]:
        return {}

    def mix(self) -> dict[str, float]:
        return {}  # no buckets: the data set as it comes


class BucketCurriculum:
    """Draw a bucket by share * max(p(1-p), floor), then that bucket's next prompt."""

    def __init__(
        self,
        prompts: Sequence[HasId],
        buckets: Sequence[str],
        seed: int,
        ema: float = 0.2,
        floor: float = 0.02,
        state: dict | None = None,
    ):
        if not prompts:
            raise ValueError("no prompts to draw from")
        if len(buckets) != len(prompts):
            raise ValueError(f"{len(buckets)} buckets for {len(prompts)} prompts")
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if not 0 <= floor <= 0.25:
            raise ValueError(f"floor must be in [0, 0.25] (p(1-p) is at most 0.25), got {floor}")
        self.prompts, self.seed, self.ema, self.floor = prompts, seed, ema, floor
        self.members: dict[str, list[int]] = {}
        for i, b in enumerate(buckets):
            self.members.setdefault(str(b), []).append(i)
        self.names = sorted(self.members, key=_natural)
        self.share = {b: len(self.members[b]) / len(prompts) for b in self.names}
        self.bucket_of = {p.id: str(b) for p, b in zip(prompts, buckets)}
        self._perm = {
            b: _Permutations(len(self.members[b]), True, lambda e, b=b: f"{seed}-{b}-{e}") for b in self.names
        }
        state = state or {}
        self.n_drawn = int(state.get("n_drawn", 0))
        self.drawn = {b: int(state.get("drawn", {}).get(b, 0)) for b in self.names}
        self.pass_rate = {b: float(state.get("pass_rate", {}).get(b, 0.5)) for b in self.names}

    def weights(self) -> list[float]:
        return [self.share[b] * max(self.pass_rate[b] * (1 - self.pass_rate[b]), self.floor) for b in self.names]

    def next(self) -> tuple[int, HasId]:
        """(epoch of the prompt's bucket, prompt) of the next draw."""
        rng = random.Random(f"{self.seed}-draw-{self.n_drawn}")
        b = rng.choices(self.names, weights=self.weights())[0]
        epoch, j = self._perm[b].at(self.drawn[b])
        self.drawn[b] += 1
        self.n_drawn += 1
        return epoch, self.prompts[self.members[b][j]]

    def observe(self, prompt_id: str, n_correct: int, n: int) -> None:
        """Fold a finished group's pass rate (n_correct of n answers) into its bucket's average."""
        if not 0 <= n_correct <= n or n <= 0:
            raise ValueError(f"a group of {n} answers cannot have {n_correct} correct")
        b = self.bucket_of[prompt_id]
        self.pass_rate[b] += self.ema * (n_correct / n - self.pass_rate[b])

    def state(self) -> dict:
        return {"n_drawn": self.n_drawn, "drawn": dict(self.drawn), "pass_rate": dict(self.pass_rate)}

    def estimates(self) -> dict[str, float]:
        """Running pass rate per bucket."""
        return dict(self.pass_rate)

    def mix(self) -> dict[str, float]:
        """The probability that the next draw comes from each bucket."""
        w = self.weights()
        return {b: x / sum(w) for b, x in zip(self.names, w)}


def describe_mix(mix: dict[str, float], by: str, top: int = 3) -> str:
    """The ``top`` most drawn buckets, e.g. ``k=6 31%, k=7 24%, k=5 18%``."""
    best = sorted(mix.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{by}={b} {p:.0%}" for b, p in best)


def _natural(name: str):
    """Numeric bucket names in numeric order (2 before 10), others after, by text."""
    try:
        return (0, float(name), "")
    except ValueError:
        return (1, 0.0, name)
