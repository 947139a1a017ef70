"""Pure scheduler state: requests and models as the scheduler sees them (sizes, queues, residency).

No torch here: this module, like the whole ``scheduler`` package, runs in the simulator and the
tests without torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class SchedRequest:
    id: str
    model: str
    prompt_len: int
    max_tokens: int
    kv_bytes: int  # cache for prompt_len + max_tokens tokens, reserved at admission
    arrival: float
    generated: int = 0
    state: str = "waiting"  # waiting | running | finished

    @property
    def prefilled(self) -> bool:
        return self.state == "running" and self.generated > 0


@dataclass(eq=False)
class ModelState:
    name: str
    weight_bytes: int
    pinned: bool = False
    resident: bool = False
    last_used: int = -1
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def oldest_arrival(self) -> float:
        times = [r.arrival for r in self.running]
        if self.waiting:
            times.append(self.waiting[0].arrival)
        return min(times) if times else float("inf")

    @property
    def kv_bytes(self) -> int:
        return sum(r.kv_bytes for r in self.running)


@dataclass
class StepPlan:
    """What one engine step does: evict, then load, then run one batch of one model.

    ``prefill``: requests whose prompts run this step (newly admitted); ``decode``: running
    requests generating their next token; ``prefetch``: loads issued for a later step, overlapped
    with this step's compute; ``failed``: requests that can never run, with the reason.
    """

    evictions: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    prefetch: list[str] = field(default_factory=list)
    model: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.evictions or self.loads or self.prefetch or self.model or self.failed)
