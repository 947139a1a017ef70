"""Pure scheduler state: requests and models as the scheduler sees them, and the plan it emits.

No torch here: this module, like the whole ``scheduler`` package, runs in the engine and the
tests without torch. Sizes are bytes per rank: ``ModelState.devices[i]`` is
the device of rank *i*, and ``weights[i]``/``block_bytes[i]`` are that rank's bytes.

The classes built per step or per request (``SchedRequest``, ``Batch``, ``StepPlan``) write their
``__init__`` out, the dataclass keeping it (and its fields, equality and repr): the compiled build
(``computron._fast``) then constructs them natively, as mypyc leaves a generated ``__init__``
interpreted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

OFFLOADED, LOADING, RESIDENT = "offloaded", "loading", "resident"


@dataclass(eq=False, slots=True)
class SharedPrefix:
    """KV-cache blocks of one prompt that its choices (``n``, ``best_of``) share: each running choice
    counts them in its ``blocks``, but they are booked once, while any of them runs (``holders``)."""

    blocks: int
    holders: int = 0


@dataclass(eq=False, slots=True)
class SchedRequest:
    id: str
    model: str
    prompt_len: int
    max_tokens: int
    arrival: float
    blocks: int = 0  # KV-cache blocks it holds (on each of its model's ranks)
    joined: int = 0  # its model's step count when it was admitted (tokens made = steps since)
    done: int = 0  # tokens it had made when it was preempted (it recomputes them when it resumes)
    due: int = -1  # the tie of its live entry in its model's growth heap (when it needs one more block)
    # waiting | running | paused (its model evicted, its blocks kept) | offloaded (paused, its blocks moved
    # to host memory: booked there, not on the devices) | finished
    state: str = "waiting"
    prefix: SharedPrefix | None = None  # blocks of its prompt it shares with the other choices of that prompt
    alone_s: float = 0.0  # slo policy: the least time from arrival to its last token, alone (a load included if cold)

    def __init__(self, id: str, model: str, prompt_len: int, max_tokens: int, arrival: float, blocks: int = 0,
                 joined: int = 0, done: int = 0, due: int = -1, state: str = "waiting",
                 prefix: SharedPrefix | None = None, alone_s: float = 0.0) -> None:
        self.id, self.model, self.prompt_len, self.max_tokens, self.arrival = id, model, prompt_len, max_tokens, arrival
        self.blocks, self.joined, self.done, self.due, self.state = blocks, joined, done, due, state
        self.prefix, self.alone_s = prefix, alone_s


@dataclass(eq=False)
class ModelState:
    name: str
    devices: tuple[int, ...]
    weights: tuple[int, ...]
    block_bytes: tuple[int, ...]  # one KV-cache block (block_tokens tokens of every layer) per rank
    pinned: bool = False
    state: str = OFFLOADED
    ready_at: float | None = None  # loading: when its copies are expected to end (None: unknown)
    last_used: int = -1  # step count of its last batch (least recently used is evicted first)
    waiting: deque[SchedRequest] = field(default_factory=deque)
    running: dict[str, SchedRequest] = field(default_factory=dict)  # req_id -> SchedRequest, in admission order
    # preempt policy: requests stopped with the model's eviction whose KV blocks stay booked on its
    # devices (or in host memory: state ``offloaded``); they run on as decodes once it is back (only
    # while it is offloaded; ``steps`` stands still)
    paused: dict[str, SchedRequest] = field(default_factory=dict)
    heap_key: float | None = None  # the oldest arrival this model is queued under in the scheduler's heap
    stopped_at: float = float("-inf")  # preempt policy: when it was last stopped for another model
    steps: int = 0  # batches it has run: a running request has made ``steps - joined`` tokens
    growth: list[tuple[int, int, SchedRequest]] = field(default_factory=list)  # heap of (due, tie, request): who needs a block when
    ends: list[tuple[int, int, SchedRequest]] = field(default_factory=list)  # heap of (step, tie, request): when running requests make their last token
    # the scheduler's epoch when it found this model unable to start (or to be prefetched): so it
    # stays until memory or what may be evicted changes
    stuck_start: int = -1
    stuck_prefetch: int = -1
    helpers: tuple[int, ...] = ()  # devices whose host links its load in flight borrows (striped swap-in)

    @property
    def on_device(self) -> bool:
        return self.state != OFFLOADED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    def oldest(self) -> float | None:
        """Arrival of its oldest outstanding request (running or waiting), None when idle."""
        a: float | None = None
        for r in (self.running or self.paused).values():  # the first (in admission order)
            a = r.arrival
            break
        w = self.waiting
        if w and (a is None or w[0].arrival < a):
            a = w[0].arrival
        return a


@dataclass(slots=True)
class Batch:
    """One model's work in a step: ``prefill`` requests (newly admitted; their prompts run) and
    ``decode`` requests (running; each generates its next token)."""

    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)

    def __init__(self, model: str, prefill: list[str] | None = None, decode: list[str] | None = None) -> None:
        self.model = model
        self.prefill = [] if prefill is None else prefill
        self.decode = [] if decode is None else decode

    @property
    def requests(self) -> list[str]:
        return self.prefill + self.decode


@dataclass
class StepPlan:
    """What one engine step does: evict, then load, then run one batch per model.

    Batches of one step use disjoint devices, or share one up to the scheduler's ``models_per_step``. ``prefetch``: loads issued for a later step,
    overlapped with this step's compute. ``preempted``: running (or paused) requests stopped to free
    KV cache (they wait again and recompute). ``paused``: running requests stopped with their
    model's eviction whose caches stay on the devices (they resume as decodes). ``kv_out``: paused requests
    whose blocks go to host memory (their device memory is needed; moving them out and back is the
    cheaper move than recomputing); ``kv_in``: such requests whose blocks come back before their model
    resumes them. ``stripes``: loads of this plan that also pull through other devices' host links
    (model -> the helper devices, in link order; their staging is booked until the load ends). ``failed``: requests that can never run, with the
    reason (the scheduler has already dropped them). ``steps``: decode steps the (single, decode-only)
    batch runs back to back; more than one only when ``schedule`` was allowed several. ``repeats``:
    the next plan is expected to be this same decode batch, one step on (a steady batch of single
    steps in which no request makes its last token; or these same batches, several models' a step), unless something happens in between that the
    scheduler cannot know now: an arrival that does not only queue, an end of another kind (EOS, a
    stop string, an abort), a change of budget. A hint an executor may act on early (the workers'
    run-ahead); nothing depends on it being right.
    """

    evictions: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    prefetch: list[str] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    kv_out: list[str] = field(default_factory=list)  # paused requests whose blocks move to host memory now
    kv_in: list[str] = field(default_factory=list)  # offloaded requests whose blocks come back (their model loads)
    failed: list[tuple[str, str]] = field(default_factory=list)
    stripes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: int = 1
    repeats: bool = False
    # Requests of a run of several steps that make their last token before its last step (req_id ->
    # the steps they run): the scheduler has ended them already; only where the executor runs such
    # runs (``ExecutorStatus.end_runs``). None: every request runs all ``steps``.
    ends: dict[str, int] | None = None

    def __init__(self, evictions: list[str] | None = None, loads: list[str] | None = None,
                 prefetch: list[str] | None = None, batches: list[Batch] | None = None,
                 preempted: list[str] | None = None, paused: list[str] | None = None, kv_out: list[str] | None = None,
                 kv_in: list[str] | None = None, failed: list[tuple[str, str]] | None = None,
                 stripes: dict[str, tuple[int, ...]] | None = None, steps: int = 1, repeats: bool = False,
                 ends: dict[str, int] | None = None) -> None:
        self.evictions = [] if evictions is None else evictions
        self.loads = [] if loads is None else loads
        self.prefetch = [] if prefetch is None else prefetch
        self.batches = [] if batches is None else batches
        self.preempted = [] if preempted is None else preempted
        self.paused = [] if paused is None else paused
        self.kv_out = [] if kv_out is None else kv_out
        self.kv_in = [] if kv_in is None else kv_in
        self.failed = [] if failed is None else failed
        self.stripes = {} if stripes is None else stripes
        self.steps = steps
        self.repeats = repeats
        self.ends = ends

    @property
    def empty(self) -> bool:
        return not (self.evictions or self.loads or self.prefetch or self.batches or self.failed or self.preempted
                    or self.kv_out or self.kv_in)
