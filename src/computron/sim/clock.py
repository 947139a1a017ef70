"""A virtual clock: time moves only when the simulation moves it."""

from __future__ import annotations


class VirtualClock:
    """Seconds of simulated time. Calling the clock reads it, so it can be injected wherever a
    ``time.perf_counter``-like callable is expected (``EngineCore(clock=...)``)."""

    __slots__ = ("t",)

    def __init__(self, start: float = 0.0):
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def __call__(self) -> float:  # the same as ``now`` (a method, not an alias: compiled classes need one)
        return self.t

    def advance_to(self, t: float) -> float:
        """Move to ``t`` (never backwards); returns the time now."""
        if t > self.t:
            self.t = t
        return self.t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"time cannot go backwards (advance by {dt})")
        self.t += dt
        return self.t

    def __repr__(self) -> str:
        return f"VirtualClock({self.t!r})"
