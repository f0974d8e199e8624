"""Answer-length distributions: heavy-tailed, clipped at the maximum generation length."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """Output lengths in tokens, clipped to [1, max_new_tokens].

    Exactly one of the shapes is used:
    * `kind="lognormal"`: median `median`, log-space standard deviation `sigma`;
    * `kind="constant"`: every answer `median` tokens;
    * `kind="empirical"`: draws with replacement from `samples`.

    Attributes:
        max_new_tokens: the clip (the generation limit).
        kind: "lognormal", "constant" or "empirical".
        median: lognormal median, or the constant length.
        sigma: lognormal sigma (0 gives a constant).
        samples: measured lengths for "empirical".
    """

    max_new_tokens: int
    kind: str = "lognormal"
    median: float = 1000.0
    sigma: float = 1.0
    samples: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"lengths.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kind not in ("lognormal", "constant", "empirical"):
            raise ValueError(f"lengths.kind must be lognormal, constant or empirical, got {self.kind!r}")
        if self.kind == "empirical":
            if not self.samples:
                raise ValueError("lengths.samples: an empirical distribution needs at least one length")
            bad = [s for s in self.samples if s < 0]
            if bad:
                raise ValueError(f"lengths.samples: lengths must be >= 0, got {bad[:5]}")
        elif self.median <= 0:
            raise ValueError(f"lengths.median must be > 0, got {self.median}")
        if self.sigma < 0:
            raise ValueError(f"lengths.sigma must be >= 0, got {self.sigma}")

    @classmethod
    def constant(cls, length: int, max_new_tokens: int | None = None) -> LengthDist:
        return cls(max_new_tokens=max_new_tokens or length, kind="constant", median=length, sigma=0.0)

    @classmethod
    def empirical(cls, samples, max_new_tokens: int) -> LengthDist:
        return cls(max_new_tokens=max_new_tokens, kind="empirical", samples=tuple(int(s) for s in samples))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant" or (self.kind == "lognormal" and self.sigma == 0):
            raw = np.full(n, float(self.median))
        elif self.kind == "lognormal":
            raw = rng.lognormal(mean=np.log(self.median), sigma=self.sigma, size=n)
        else:
            raw = rng.choice(np.asarray(self.samples, dtype=float), size=n)
        return np.clip(np.rint(raw), 1, self.max_new_tokens).astype(np.int64)

    def mean(self, n: int = 200_000, seed: int = 0) -> float:
        """Mean of the clipped distribution (Monte Carlo for the lognormal)."""
        return float(self.sample(np.random.default_rng(seed), n).mean())
