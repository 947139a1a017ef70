"""Everything that crosses between the engine core and an executor: plain, torch-free dataclasses.

The engine core (``engine/core.py``) speaks to an executor only through these messages, so any
executor fits behind it: the one in this process today, one worker process per GPU, or a
simulation. Only names, ints, floats and token ids cross: tensors stay on the executor's side. Importing this
module imports neither torch nor any other part of the engine.

The messages of every step (``SeqInput``, ``ExecuteBatch``, ``StepResult``) write their ``__init__``
out (the dataclass keeping it, with its fields, equality and repr) and pickle by it: the optional
compiled build (``computron._fast``) then makes them native classes, built without the interpreter.
The other classes stay plain Python classes there (``native_class=False``): they are built seldom,
and some take values of other types than they declare (converted in ``__post_init__``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ._mypyc import mypyc_attr
from .models.config import ModelConfig
from .parallel.dims import ParallelDims

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens; validated on the host when the request is made.

    Temperature 0 (or below ``GREEDY_BELOW``) is greedy: dividing logits by a vanishing
    temperature would overflow them. A request with a seed draws from its own generator, so its
    tokens do not depend on what else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence is masked until this many tokens were generated
    presence_penalty: float = 0.0  # subtracted from the logit of each token generated so far
    frequency_penalty: float = 0.0  # times how often it was generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens seen
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # return the chosen token's log-probability and this many of the most likely
    prompt_logprobs: int | None = None  # return each prompt token's log-probability given those before it, and
    # this many of the most likely at each position

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            errors.append(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            errors.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                errors.append(f"{name} must be between -2 and 2, got {getattr(self, name)!r}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            errors.append(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if any(not isinstance(t, int) or t < 0 or not -100.0 <= float(b) <= 100.0 for t, b in self.logit_bias):
            errors.append("logit_bias must map token ids (non-negative integers) to values between -100 and 100")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= 20):
                errors.append(f"{name} must be an integer between 0 and 20, got {k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            errors.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            errors.append(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            errors.append(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            errors.append(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            errors.append("stop must be a list of non-empty strings")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# ---- models ------------------------------------------------------------------------------------
@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class Placement:
    """Where one model runs: its parallel layout and the device of each of its ranks.

    Ranks are numbered pipeline stage by stage, tensor rank fastest:
    rank = stage * tp + tensor_rank. ``devices[rank]`` is that rank's device index.
    """

    dims: ParallelDims = ParallelDims()
    devices: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.dims.dp != 1:
            raise ValueError(f"a served model has no data parallelism (dp={self.dims.dp}); register copies instead")
        if len(self.devices) != self.dims.world_size:
            raise ValueError(f"{self.dims} needs {self.dims.world_size} devices, got {len(self.devices)}: "
                             f"{list(self.devices)}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"a model's ranks need distinct devices, got {list(self.devices)}")


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class ModelDescription:
    """What the engine asks an executor to register: where the weights come from and where they go."""

    name: str
    source: str  # a preset name or a Hugging Face checkpoint directory
    dtype: str | None = None
    seed: int = 0  # presets: random weights from this seed
    placement: Placement = Placement()
    max_bytes: int | None = None  # refuse a model whose shard on any device exceeds this


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class ModelInfo:
    """An executor's answer to a registration: the model's shape and its bytes on each rank."""

    name: str
    config: ModelConfig
    checkpoint: str | None
    placement: Placement
    weight_bytes: tuple[int, ...]  # per rank: the shard's image, as the device region holds it
    kv_bytes_per_token: tuple[int, ...]  # per rank: key/value cache bytes of one token

    @property
    def total_bytes(self) -> int:
        return sum(self.weight_bytes)


# ---- steps -------------------------------------------------------------------------------------
def _by_fields(msg) -> tuple:
    """How a step's message pickles: its class and its fields in order (a compiled one is rebuilt by
    its ``__init__``, as the same class of the Python modules is)."""
    return type(msg), tuple(getattr(msg, f.name) for f in fields(msg))


@mypyc_attr(native_class=False)
@dataclass
class Residency:
    """Memory changes, applied in order: KV caches of preempted requests released (their sampling
    state kept: they resume by recomputing), KV caches of stopped requests moved to host memory
    (``kv_out``: their device blocks freed), evictions (nothing copied back), loads (asynchronous
    copies; compute may start while they are in flight), then KV caches brought back from host
    memory (``kv_in``: blocks taken again, the requests decode on where they stopped).
    ``stripes``: loads of one-device models that also pull through other devices' host links (the
    worker executor's striped swap-in): model -> the helper devices, in link order; a worker that
    is named there and does not hold the model relays its chunks of the image to the model's."""

    evict: list[str] = field(default_factory=list)
    load: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    kv_out: list[str] = field(default_factory=list)
    kv_in: list[str] = field(default_factory=list)
    stripes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.evict or self.load or self.release or self.kv_out or self.kv_in or self.stripes)


@dataclass(slots=True)
class SeqInput:
    req_id: str
    tokens: list[int]  # the new tokens of this step (the prompt on prefill, one token on decode); read only:
    # a prefill's may be the request's own prompt list
    past: int  # tokens already in the request's cache (0: a prefill, or a recompute after preemption)
    params: SamplingParams
    # A prefill whose first tokens' cache another request (a choice of the same prompt) holds: (its id, how
    # many tokens, whole blocks of the prompt). Those blocks are shared, only ``tokens[n:]`` are computed.
    share: tuple[str, int] | None = None
    prompt_logprobs: int | None = None  # a prefill: also the log-probability of each of tokens[1:] (and top-k)

    def __init__(self, req_id: str, tokens: list[int], past: int, params: SamplingParams,
                 share: tuple[str, int] | None = None, prompt_logprobs: int | None = None) -> None:
        self.req_id, self.tokens, self.past, self.params = req_id, tokens, past, params
        self.share, self.prompt_logprobs = share, prompt_logprobs

    def __reduce__(self) -> tuple:
        return _by_fields(self)


@dataclass
class ExecuteBatch:
    model: str
    seqs: list[SeqInput]
    trace: bool = False  # record when each layer group's copy ended and its compute started
    steps: int = 1  # decode steps to run back to back (each feeds its token to the next); > 1: decode only
    # The engine expects to ask next for this batch again, every sequence one token on (its plan
    # ``repeats``): an executor may start that step early and use it if so (the workers' run-ahead).
    ahead: bool = False
    # Sequences that run fewer of the ``steps`` (req_id -> how many: they make their last token then);
    # only for an executor that runs such runs (``ExecutorStatus.end_runs``). None: all run ``steps``.
    lasts: dict[str, int] | None = None

    def __init__(self, model: str, seqs: list[SeqInput], trace: bool = False, steps: int = 1,
                 ahead: bool = False, lasts: dict[str, int] | None = None) -> None:
        self.model, self.seqs, self.trace, self.steps, self.ahead = model, seqs, trace, steps, ahead
        self.lasts = lasts

    def __reduce__(self) -> tuple:
        return _by_fields(self)


@dataclass
class StepResult:
    """What one ``execute`` call produced, for all of its batches."""

    tokens: dict[str, int | list[int]] = field(default_factory=dict)  # req_id -> next token (a list of
    # ``steps`` tokens for a batch of several steps)
    # req_id -> (the token's log-probability, [(id, log-probability)] of the most likely), when asked (a
    # list of those for a batch of several steps)
    logprobs: dict[str, tuple | list[tuple]] = field(default_factory=dict)
    # req_id -> per token of a prefill that asked, after the first: (log-probability, [(id, log-probability)])
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    loaded: dict[str, float] = field(default_factory=dict)  # model -> seconds its swap-in copies took
    compute_s: dict[str, float] = field(default_factory=dict)  # model -> seconds of its batch
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> why it could not run
    # Devices whose worker died: everything on them is gone, and the requests that ran there fail.
    lost_devices: list[int] = field(default_factory=list)
    # Devices whose worker was restarted without dying (with the world of a dead one): their models'
    # weights and KV caches are gone, their requests are not (they recompute when they run again).
    reset_devices: list[int] = field(default_factory=list)
    trace: dict[str, dict] = field(default_factory=dict)  # model -> copy ends / compute starts (seconds)
    # model -> when (the engine's clock) the first step of its batch ended, for a batch of several steps
    # whose first prefills (its new requests' first tokens came then, not at the run's end); None: none
    first_at: dict[str, float] | None = None
    # req_id -> when (the engine's clock) the step of its last token ended, for the sequences of
    # ``ExecuteBatch.lasts``; None: none
    ended_at: dict[str, float] | None = None

    def __init__(self, tokens: dict[str, int | list[int]] | None = None,
                 logprobs: dict[str, tuple | list[tuple]] | None = None, prompt_logprobs: dict[str, list] | None = None,
                 loaded: dict[str, float] | None = None, compute_s: dict[str, float] | None = None,
                 failed: dict[str, str] | None = None, lost_devices: list[int] | None = None,
                 reset_devices: list[int] | None = None, trace: dict[str, dict] | None = None,
                 first_at: dict[str, float] | None = None, ended_at: dict[str, float] | None = None) -> None:
        self.tokens = {} if tokens is None else tokens
        self.logprobs = {} if logprobs is None else logprobs
        self.prompt_logprobs = {} if prompt_logprobs is None else prompt_logprobs
        self.loaded = {} if loaded is None else loaded
        self.compute_s = {} if compute_s is None else compute_s
        self.failed = {} if failed is None else failed
        self.lost_devices = [] if lost_devices is None else lost_devices
        self.reset_devices = [] if reset_devices is None else reset_devices
        self.trace = {} if trace is None else trace
        self.first_at = first_at
        self.ended_at = ended_at

    def __reduce__(self) -> tuple:
        return _by_fields(self)


@mypyc_attr(native_class=False)
@dataclass
class DeviceStatus:
    index: int
    name: str  # "cuda:0", "cpu"
    capacity: int  # bytes of the arena (weights + KV cache)
    weights: int = 0
    kv: int = 0
    compactions: int = 0
    budget: int = 0  # the whole device budget: the arena plus the workspace for activations
    held: int = -1  # bytes the arena spans now (colocation shrinks it below capacity); -1: capacity


@mypyc_attr(native_class=False)
@dataclass
class ExecutorStatus:
    devices: list[DeviceStatus]
    models: dict[str, str]  # name -> "resident" | "loading" (copies in flight); absent: offloaded
    kv_block_tokens: int = 16  # tokens per block of its paged KV caches
    stats: dict = field(default_factory=dict)  # counters of its own (e.g. CUDA graph captures and their seconds)
    # a batch of several steps may start with prefills (its later steps decode them too); the simulator's
    prefill_runs: bool = False
    # a batch of several steps may have sequences that end before its last (``ExecuteBatch.lasts``)
    end_runs: bool = False
