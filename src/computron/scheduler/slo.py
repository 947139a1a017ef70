"""The ``slo`` policy's side of the scheduler: what each step costs, each request's deadline and slack.

Pure (no torch): a model's ``ModelCost`` (seconds to load it, to prefill, to run a decode step; an
affine model the simulator's calibration or a measurement gives) and its ``Slo`` (time to first
token and time per output token) are given when it is registered. From them a request of
``max_tokens`` tokens arriving at ``a`` is due by ``a + ttft_s + (max_tokens - 1) * tpot_s``, and its
*slack* is that deadline less when it would end if its model ran every step from now on (a load
first if the model is not on its devices, a prefill if it is not running). The scheduler runs
models in order of their earliest deadline and uses slack to decide when a waiting model must stop
running ones; ``Deadlines`` (a part of the ``Scheduler``, which owns the state) computes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Final

from .state import OFFLOADED, ModelState, SchedRequest


@dataclass(frozen=True)
class ModelCost:
    """Seconds one model's work takes on its devices (affine in tokens and batch size)."""

    load_s: float  # weights host -> device (bytes / measured bandwidth), through every stripe link
    prefill_fixed_s: float
    prefill_token_s: float
    decode_fixed_s: float
    decode_seq_s: float
    load_links_s: tuple[float, ...] = ()  # striped loads: the load with 0, 1, ... helpers' links lent
    # several models a step (models_per_step): what its batch adds to a step another model's batch
    # leads, as a fraction of its time alone (1: one after another)
    shared_fraction: float = 1.0

    def load(self, links: int | None = None) -> float:
        """Seconds to load with ``links`` helpers' host links lent (None: as ``load_s``)."""
        if links is None or not self.load_links_s:
            return self.load_s
        return self.load_links_s[min(links, len(self.load_links_s) - 1)]

    @classmethod
    def from_calibration(cls, cal, weight_bytes: tuple[int, ...], devices: tuple[int, ...],
                         stripe: tuple[int, ...] = ()) -> "ModelCost":
        """The cost of a model of ``weight_bytes`` per rank on ``devices`` from a calibration (an object
        with ``load_time(nbytes, device, pageable, helpers)``, ``prefill_time(nbytes, tokens)`` and
        ``decode_time(nbytes, batch)``, as the simulator's): the slowest rank's, its affine terms read at
        1 and 2. ``stripe``: devices whose links a one-device model's loads also pull through."""
        b = max(weight_bytes)
        p1, p2 = cal.prefill_time(b, 1), cal.prefill_time(b, 2)
        d1, d2 = cal.decode_time(b, 1), cal.decode_time(b, 2)
        helpers = tuple(h for h in stripe if h != devices[0]) if len(devices) == 1 else ()
        links = tuple(max(cal.load_time(w, d, False, helpers[:k]) for w, d in zip(weight_bytes, devices))
                      for k in range(len(helpers) + 1))
        return cls(links[-1], 2 * p1 - p2, p2 - p1, 2 * d1 - d2, d2 - d1, links if helpers else (),
                   getattr(cal, "concurrent_step_fraction", 1.0))

    def prefill(self, tokens: int) -> float:
        return self.prefill_fixed_s + tokens * self.prefill_token_s

    def decode(self, batch: int) -> float:
        return self.decode_fixed_s + batch * self.decode_seq_s


@dataclass(frozen=True)
class Slo:
    """A model's service objectives: seconds to the first token and per output token after it."""

    ttft_s: float
    tpot_s: float
    latency_s: float | None = None  # arrival to last token, for every request alike (None: by its length)

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and (self.latency_s is None or self.latency_s > 0)):
            raise ValueError(f"SLO times must be positive, got ttft_s={self.ttft_s!r}, tpot_s={self.tpot_s!r}, "
                             f"latency_s={self.latency_s!r}")

    def due(self, arrival: float, tokens: int) -> float:
        """When a request of ``tokens`` output tokens arriving at ``arrival`` must have ended."""
        if self.latency_s is not None:
            return arrival + self.latency_s
        return arrival + self.ttft_s + (tokens - 1) * self.tpot_s

    def met(self, arrival: float, first_token_at: float, finished_at: float, tokens: int) -> bool:
        """Did a request that completed meet this SLO: with ``latency_s``, ended within it of its
        arrival (what ``due`` aims at); else its first token within ``ttft_s`` and the later ones within
        ``tpot_s`` each on average."""
        if self.latency_s is not None:
            return finished_at - arrival <= self.latency_s
        return first_token_at - arrival <= self.ttft_s and \
            (tokens < 2 or (finished_at - first_token_at) / (tokens - 1) <= self.tpot_s)

    def describe(self) -> str:
        if self.latency_s is not None:
            return f"ended within {self.latency_s:.3f} s of its arrival"
        return f"first token within {self.ttft_s:.3f} s, then {self.tpot_s * 1e3:.2f} ms per token"

    @classmethod
    def solo(cls, cost: ModelCost, scale: float, prompt: int = 512) -> "Slo":
        """``scale`` times the model's solo figures on its devices, warm: a ``prompt``-token prefill for
        the first token, a decode step of one sequence for each later one (a request's deadline is
        then ``scale`` times its solo latency)."""
        return cls(scale * cost.prefill(prompt), scale * cost.decode(1))


class Deadlines:
    """Deadlines, slack and admission under the ``slo`` policy, and what a switch should keep. It holds
    each model's cost and SLO; the requests and models themselves are the ``Scheduler``'s."""

    LOOK: Final = 4  # waiting requests of a model looked at (its queue is in arrival order)

    def __init__(self, max_wait_s: float, models_per_step: int = 1):
        self.max_wait_s = max_wait_s
        self.models_per_step = models_per_step  # batches of different models a step may run on a device
        self.now = 0.0  # the time of the last step planned
        self.costs: dict[str, ModelCost] = {}
        self.slos: dict[str, Slo] = {}
        # the helpers' links a load of the model would be lent now (the scheduler's, when it lends
        # them load by load); None: every load goes through all of them (``load_s``)
        self.links: Callable[[ModelState], int] | None = None

    def load_s(self, m: ModelState) -> float:
        """Seconds a load of ``m`` starting now would take."""
        return self.costs[m.name].load(None if self.links is None else self.links(m))

    def earliest(self, m: ModelState) -> float | None:
        """The earliest deadline among the model's running, paused and first waiting requests (None
        when it has none; -inf past the bound on waiting): the models' order."""
        if self.past_bound(m):
            return -math.inf
        due = [self.due(r) for r in (*m.running.values(), *m.paused.values())]
        due += [self.due(r) for r in list(m.waiting)[:self.LOOK]]
        return min(due) if due else None

    def past_bound(self, m: ModelState) -> bool:
        """Has the head of ``m``'s queue waited the bound (at ``now``, the last step's time) without
        starting? Then it goes first."""
        return bool(m.waiting) and not m.waiting[0].done and self.now - m.waiting[0].arrival >= self.max_wait_s

    def restart(self, c: ModelState) -> float:
        """Seconds stopping ``c`` now costs it: a reload and a prefill of what its requests hold."""
        return self.load_s(c) + self.costs[c.name].prefill(sum(r.prompt_len + c.steps - r.joined
                                                               for r in c.running.values()))

    def due(self, req: SchedRequest) -> float:
        """Its SLO's deadline, but never before it could end alone (``alone``): a request its SLO
        could not serve even on an idle device (a cold model's load longer than the time to first
        token, say) is served as soon as it can be, and refused only when other work makes it later."""
        return max(self.slos[req.model].due(req.arrival, req.max_tokens), req.arrival + req.alone_s)

    def alone(self, m: ModelState, req: SchedRequest) -> float:
        """Seconds from now until ``req`` could end if only it ran: ``m``'s load (if not on its
        devices), the prefill of its prompt, a decode step of one for each later token."""
        cost = self.costs[m.name]
        return self._start(m, req.arrival) + cost.prefill(req.prompt_len) + (req.max_tokens - 1) * cost.decode(1)

    def _start(self, m: ModelState, now: float) -> float:
        """Seconds before ``m`` can compute: its load (what is left of it), or nothing."""
        if m.state == OFFLOADED:
            return self.load_s(m)
        return max(0.0, m.ready_at - now) if m.ready_at is not None else 0.0

    def slack(self, m: ModelState, now: float) -> float:
        """Least slack among the model's running, paused and first waiting requests (seconds)."""
        cost = self.costs[m.name]
        start = self._start(m, now)
        batch = len(m.running) + len(m.paused) + min(len(m.waiting), self.LOOK)
        step = cost.decode(batch)
        least = math.inf
        for r in (*m.running.values(), *m.paused.values()):
            left = r.max_tokens - (m.steps - r.joined)
            least = min(least, self.due(r) - now - start - left * step)
        if m.waiting:
            begin = start + cost.prefill(sum(r.prompt_len + r.done for r in list(m.waiting)[:self.LOOK]))
            for i, r in enumerate(m.waiting):
                if i == self.LOOK:
                    break
                least = min(least, self.due(r) - now - begin - (r.max_tokens - r.done - 1) * step)
        return least

    def crowded(self, models, now: float) -> list[tuple[ModelState, SchedRequest]]:
        """Waiting requests to refuse so that the others meet their deadlines (Moore and Hodgson's
        rule): the models' work in deadline order on their devices, each request adding what it needs
        beyond what its model's earlier requests already run (a step serves its whole batch);
        wherever the work so far ends past a deadline, the unstarted request on those devices that
        needs the most time goes. With several models a step (``models_per_step`` k > 1), the k or
        fewer models with work on a device share its steps: each one's work counts
        (1 + f (k - 1)) / k of its time alone, f its cost's ``shared_fraction``."""
        jobs: list[tuple[float, float, ModelState, SchedRequest | None]] = []
        share: dict[str, float] = {}
        if self.models_per_step > 1:
            busy: dict[int, int] = {}  # per device: models with work on it (those elsewhere share no step yet)
            for m in models:
                if m.on_device:
                    for d in m.devices:
                        busy[d] = busy.get(d, 0) + 1
            for m in models:
                n = min(self.models_per_step, max(max(busy.get(d, 0) for d in m.devices), 1))
                share[m.name] = (1.0 + self.costs[m.name].shared_fraction * (n - 1)) / n
        for m in models:
            cost = self.costs[m.name]
            step = cost.decode(max(len(m.running) + len(m.paused), 1))
            for r in (*m.running.values(), *m.paused.values()):
                jobs.append((self.due(r), (r.max_tokens - (m.steps - r.joined)) * step, m, None))
            for r in list(m.waiting)[:self.LOOK]:
                jobs.append((self.due(r), cost.prefill(r.prompt_len + r.done) + (r.max_tokens - r.done - 1) * step,
                             m, None if r.done else r))
        jobs.sort(key=lambda j: j[0])
        t: dict[int, float] = {}  # per device: when the work laid out so far ends
        counted: dict[str, float] = {}
        started: set[str] = set()
        out: list[tuple[ModelState, SchedRequest]] = []
        kept: list[tuple[float, ModelState, SchedRequest]] = []
        for due, need, m, r in jobs:
            extra = 0.0 if m.name in started else self._start(m, now)
            started.add(m.name)
            more = max(0.0, need - counted.get(m.name, 0.0)) + extra
            if share:
                more *= share[m.name]
            counted[m.name] = max(counted.get(m.name, 0.0), need)
            end = max(t.get(d, now) for d in m.devices) + more
            for d in m.devices:
                t[d] = end
            if r is not None:
                kept.append((more, m, r))
            if end > due:  # give up the request on these devices that needs the most time
                mine = [k for k in kept if not set(k[1].devices).isdisjoint(m.devices)]
                if mine:
                    k = max(mine, key=lambda k: k[0])
                    kept.remove(k)
                    out.append((k[1], k[2]))
                    for d in k[1].devices:
                        t[d] -= k[0]
        return out

    def refusal(self, m: ModelState, r: SchedRequest, now: float) -> str:
        slo = self.slos[m.name]
        return (f"model {m.name!r} is overloaded: request {r.id!r} (waiting {now - r.arrival:.3f} s) cannot be "
                f"served within its SLO ({slo.describe()}: due {self.due(r) - r.arrival:.3f} s after it arrived), "
                f"or only by making requests due "
                f"sooner miss theirs; retry later")

    def move_s(self, c: ModelState, r: SchedRequest) -> float:
        """Seconds to move a request's KV blocks to host memory and back over its model's link: twice
        its bytes at the bandwidth its load measures (weights per rank / load seconds), slowest rank."""
        load_s = self.costs[c.name].load(0)  # caches move over the model's own links only
        return 2 * max(r.blocks * bb * load_s / w if w else 0.0 for w, bb in zip(c.weights, c.block_bytes))

    def moves(self, c: ModelState, r: SchedRequest) -> bool:
        """Is moving the request's blocks out and back cheaper than recomputing them (a prefill of its
        prompt and the tokens it made)?"""
        return self.move_s(c, r) < self.costs[c.name].prefill(r.prompt_len + c.steps - r.joined)

    def keeps(self, c: ModelState, spare: dict[int, int]) -> list[SchedRequest]:
        """Running requests of ``c``, being stopped, whose KV blocks stay on the devices: a block kept
        costs memory, a block dropped costs its share of a prefill when the request resumes. Blocks
        are kept only out of ``spare`` (bytes per device nobody needs after the switch), the requests
        that would cost most to recompute per byte first; the rest recompute."""
        cost = self.costs[c.name]
        reqs = sorted(c.running.values(), reverse=True,
                      key=lambda r: cost.prefill(r.prompt_len + c.steps - r.joined) / max(r.blocks, 1))
        kept = []
        left = dict(spare)
        for r in reqs:
            if r.prefix is not None:  # the choices of a prompt share blocks: they recompute, all of them
                continue
            take = {d: r.blocks * bb for d, bb in zip(c.devices, c.block_bytes)}
            if all(left.get(d, 0) >= n for d, n in take.items()):
                kept.append(r)
                for d, n in take.items():
                    left[d] -= n
        return kept
