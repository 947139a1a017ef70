"""`make_workload`: models × rates × arrival process × lengths → one `Trace`.

Each model gets its own arrival stream at its rate (`arrivals.model_rates`: explicit `rates`, or
total `rate` split by power-law `skew`), from the chosen process:

- "gamma": `Gamma(rate_i, cv, start)` (cv=1 is Poisson; cv>1 burstier, cv<1 more regular; each
  stream stationary from 0 unless `start="arrival"`: see `arrivals`);
- "poisson": `Poisson(rate_i)` (cv ignored);
- "bursts": `Bursts.with_mean_rate(rate_i, on_s, off_s)`: on/off bursts whose long-run rate is
  rate_i, so the rate during on periods is rate_i*(on_s+off_s)/on_s.

Each request's (prompt, output) lengths come from `lengths` (a pair sampler such as
`Pairs(trace.pairs())`) or else from `prompt` and `output` (int = fixed, (lo, hi) = uniform
inclusive, or a distribution). The streams are merged and sorted by time.

Randomness: `SeedSequence(seed)` spawns one child per model (in the order given), which spawns
one stream for arrivals and one for lengths, so the same arguments and seed give the identical
trace, and a model's arrivals do not depend on the length settings.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .arrivals import STARTS, Bursts, Gamma, Poisson, model_rates
from .lengths import Lengths, PairSampler
from .trace import Request, Trace

PROCESSES = ("gamma", "poisson", "bursts")


def make_workload(models: Sequence[str], rate: float | None, duration: float, cv: float = 1.0,
                  skew: float = 0.0, rates: Sequence[float] | None = None,
                  prompt=512, output=128, lengths: PairSampler | None = None, seed: int = 0,
                  process: str = "gamma", on_s: float = 10.0, off_s: float = 10.0,
                  start: str = "stationary") -> Trace:
    """A trace of `duration` seconds over `models` (see the module docstring)."""
    if isinstance(models, str):
        models = [models]
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {PROCESSES}, got {process!r}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    if not (duration >= 0):
        raise ValueError(f"duration must be >= 0, got {duration!r}")
    per_model = model_rates(models, rate, skew=skew, rates=rates)
    pairs = lengths if lengths is not None else Lengths.of(prompt, output)
    children = np.random.SeedSequence(seed).spawn(len(per_model))
    requests: list[Request] = []
    for (model, r), child in zip(per_model.items(), children):
        arrival_seed, length_seed = child.spawn(2)
        if process == "gamma":
            proc = Gamma(r, cv, start)
        elif process == "poisson":
            proc = Poisson(r)
        else:
            proc = Bursts.with_mean_rate(r, on_s, off_s)
        times = proc.times(duration, np.random.default_rng(arrival_seed))
        p, o = pairs.sample(len(times), np.random.default_rng(length_seed))
        requests += [Request(float(t), model, int(a), int(b)) for t, a, b in zip(times, p, o)]
    return Trace(requests)
