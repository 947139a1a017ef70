"""Training memory model: peak bytes as a function of the micro-batch size, fitted online.

Pure (no torch). Training's peak in a micro-batch of ``m`` samples is close to affine: a fixed
part (weights, gradients, optimizer state, the gradient buffer of the micro-batch) plus
activations per sample. The trainer records the measured peak of each micro-batch; the model
fits ``peak(m) = fixed + per_sample * m`` by least squares over the recorded points, adds a
margin (the largest under-prediction seen, and a relative one on the activations), and answers the question the
arbiter asks: the largest micro-batch whose peak fits a limit. Before two distinct sizes have
been measured it answers from a prior (an estimate from the model's shape) scaled to the
measurement it has.

The fitted slope never goes below half the prior's (``slope_floor``): peaks are noisy and the model
keeps the largest seen per size, so two sizes close together can fit a slope of 0, and every size
then looks as large as the largest: a limit the job could run in at a smaller size paused it for
good. Activations do grow with the micro-batch; a size measured after that shows its own peak, and
the margin (the largest under-prediction seen) takes in any that the floor made optimistic.

The relative margin covers the activations (``per_sample * m``), not the whole peak: the fixed part
is weights, gradients and optimizer state, the same bytes at every size, and what the fit gets wrong
there shows up as an under-prediction at a measured size. A margin on the whole peak (800 MiB of a
GPT-2-medium job's 16 GiB) put the job's usual micro-batch of 16 on a knife's edge in the hybrid
bench: the same 16.41 GiB limit kept it at 16 on one lease and cut it to 11 on the next, a third of
its throughput gone (bench/results/hybrid_h200_s34/README.md).

A size's point is the largest of its last ``window`` peaks, not of all it ever had. A peak that a
moment inflated (a micro-batch right after a handover measured 5.3 GiB over the same size's steady
peak for two steps on an H200, bench/results/hybrid_h200_s38/README.md) kept as the size's largest for
good raised every prediction through the fit and its margin: the job then paused under a static split
it had run in at micro-batch 8 one run before, and stayed paused. Measured again ``window`` times at
its steady peak, the size forgets it; a size not measured again keeps it, on the safe side.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class MemoryModel:
    prior_fixed: int  # bytes: the estimate before any measurement
    prior_per_sample: int
    rel_margin: float = 0.05
    slope_floor: float = 0.5  # the fitted per-sample bytes are at least this share of the prior's
    window: int = 8  # a size's point is the largest of its last this many peaks
    points: dict[int, int] = field(default_factory=dict)  # micro-batch size -> largest of its recent peaks
    _recent: dict[int, collections.deque] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window is the peaks a size keeps, at least 1; got {self.window}")

    def record(self, micro_batch: int, peak_bytes: int) -> None:
        if micro_batch < 1 or peak_bytes < 0:
            raise ValueError(f"a measurement needs micro_batch >= 1 and peak >= 0, got {micro_batch}, {peak_bytes}")
        recent = self._recent.get(micro_batch)
        if recent is None:  # a point the model was made with counts as one of the size's peaks
            recent = self._recent[micro_batch] = collections.deque(
                [self.points[micro_batch]] if micro_batch in self.points else [], maxlen=self.window)
        recent.append(peak_bytes)
        self.points[micro_batch] = max(recent)

    def coefficients(self) -> tuple[float, float]:
        """(fixed, per_sample) bytes: least squares over the measurements, else the prior."""
        pts = sorted(self.points.items())
        if len(pts) >= 2:
            n = len(pts)
            mx = sum(m for m, _ in pts) / n
            my = sum(p for _, p in pts) / n
            sxx = sum((m - mx) ** 2 for m, _ in pts)
            slope = max(self.prior_per_sample * self.slope_floor, sum((m - mx) * (p - my) for m, p in pts) / sxx)
            return my - slope * mx, slope
        if len(pts) == 1:  # one measurement: the prior's slope through it
            (m, p), = pts
            return p - self.prior_per_sample * m, float(self.prior_per_sample)
        return float(self.prior_fixed), float(self.prior_per_sample)

    def predict(self, micro_batch: int) -> int:
        """Peak bytes of a micro-batch of that size, margin included."""
        fixed, per = self.coefficients()
        under = max((p - (fixed + per * m) for m, p in self.points.items()), default=0.0)
        return int(fixed + per * micro_batch * (1 + self.rel_margin) + max(0.0, under))

    def largest(self, limit: int, most: int) -> int:
        """The largest micro-batch in 1..``most`` predicted to fit ``limit`` bytes; 0 if none does."""
        lo, hi = 0, most
        while lo < hi:  # predict is non-decreasing in the size
            mid = (lo + hi + 1) // 2
            if self.predict(mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo


def estimate(num_params: int, param_bytes: int, tokens_per_sample: int, hidden: int, layers: int, vocab: int,
             act_bytes: int) -> tuple[int, int]:
    """A prior (fixed, per-sample bytes) for a decoder trained with AdamW.

    Fixed: weights + gradient accumulator + one micro-batch's gradients + two fp32 Adam moments.
    Per sample: roughly 16 hidden-sized activations per token and layer kept for the backward,
    and the logits with their softmax in float32.
    """
    fixed = num_params * (3 * param_bytes + 8)
    per_sample = tokens_per_sample * (16 * hidden * layers * act_bytes + 2 * vocab * 4)
    return fixed, per_sample
