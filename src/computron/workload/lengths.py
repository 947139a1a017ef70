"""Prompt and output lengths in tokens.

A length distribution turns (n, random source) into n non-negative integer token counts:
`Fixed(k)` always k, `Uniform(lo, hi)` uniform over the integers lo..hi inclusive. `Lengths`
pairs a prompt distribution with an output distribution (drawn independently); `Pairs` draws
(prompt, output) pairs jointly, with replacement, from a list of observed pairs (a trace's
`Trace.pairs()`, or `importers.read_sharegpt`). Both pair samplers answer
`sample(n, rng) -> (prompts, outputs)` as int64 arrays.

`as_length(spec)` reads the shorthand `make_workload` accepts: an int is `Fixed`, a (lo, hi)
tuple is `Uniform`, a distribution is itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .arrivals import as_rng


class LengthDist(Protocol):
    def sample(self, n: int, rng=None) -> np.ndarray: ...


class PairSampler(Protocol):
    def sample(self, n: int, rng=None) -> tuple[np.ndarray, np.ndarray]: ...


def _check_count(v, name: str) -> None:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {v!r}")


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def __post_init__(self):
        _check_count(self.tokens, "tokens")

    def sample(self, n: int, rng=None) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Uniform over the integers lo..hi inclusive."""

    lo: int
    hi: int

    def __post_init__(self):
        _check_count(self.lo, "lo")
        _check_count(self.hi, "hi")
        if self.hi < self.lo:
            raise ValueError(f"need lo <= hi, got [{self.lo}, {self.hi}]")

    def sample(self, n: int, rng=None) -> np.ndarray:
        return as_rng(rng).integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)


def as_length(spec) -> LengthDist:
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        return Fixed(int(spec))
    if isinstance(spec, tuple) and len(spec) == 2:
        return Uniform(int(spec[0]), int(spec[1]))
    if hasattr(spec, "sample"):
        return spec
    raise ValueError(f"a length is an int, a (lo, hi) tuple or a distribution, got {spec!r}")


@dataclass(frozen=True)
class Lengths:
    """Independent prompt and output lengths."""

    prompt: LengthDist
    output: LengthDist

    @classmethod
    def of(cls, prompt, output) -> "Lengths":
        return cls(as_length(prompt), as_length(output))

    def sample(self, n: int, rng=None) -> tuple[np.ndarray, np.ndarray]:
        g = as_rng(rng)
        return self.prompt.sample(n, g), self.output.sample(n, g)


class Pairs:
    """(prompt, output) pairs drawn jointly, uniformly with replacement, from observed pairs."""

    def __init__(self, pairs: Sequence[tuple[int, int]]):
        arr = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2) if len(pairs) else None
        if arr is None or arr.shape[0] == 0:
            raise ValueError("Pairs needs at least one (prompt, output) pair")
        if (arr < 0).any():
            raise ValueError("token counts must be >= 0")
        self.pairs = arr

    def __repr__(self) -> str:
        return f"Pairs({len(self.pairs)} pairs)"

    def sample(self, n: int, rng=None) -> tuple[np.ndarray, np.ndarray]:
        idx = as_rng(rng).integers(0, len(self.pairs), size=n)
        chosen = self.pairs[idx]
        return chosen[:, 0].copy(), chosen[:, 1].copy()
