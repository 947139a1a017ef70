"""Configuration: one dataclass per component, composed into ``ComputronConfig``.

Precedence: command-line flags override the YAML file, which overrides these defaults. No I/O
happens in constructors; ``load_config`` reads the file.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(value: str | int | float | None) -> int | None:
    """'40GiB', '512MB', '1.5g', 1024 -> bytes. None stays None (meaning: pick a default)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 40GiB, 512MB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class ModelSpec:
    """A model to serve: a preset name or a checkpoint directory, under an optional alias."""

    source: str
    alias: str | None = None
    pinned: bool = False
    dtype: str | None = None
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks
    pp: int = 1  # pipeline stages
    devices: list[int] | None = None  # the device of each rank (rank = stage * tp + tensor rank); None: 0, 1, ...

    @property
    def name(self) -> str:
        return self.alias or Path(self.source).name

    def placement(self):
        """The ``messages.Placement`` this spec asks for (validated there)."""
        from .messages import Placement
        from .parallel.dims import ParallelDims

        dims = ParallelDims(tp=self.tp, pp=self.pp)
        return Placement(dims, tuple(self.devices) if self.devices is not None else tuple(range(dims.world_size)))

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        """'opt-1.3b', '/ckpt/llama=chat' (alias after '='), 'opt-13b@tp=2' or
        'opt-13b=big@tp=2,pp=2,devices=0+1+2+3' (a layout after '@')."""
        head, at, layout = text.partition("@")
        source, _, alias = head.partition("=")
        if not source:
            raise ValueError(f"empty model in {text!r}; write NAME_OR_DIR[=ALIAS][@tp=N,pp=N,devices=A+B]")
        spec = cls(source=source, alias=alias or None)
        for item in layout.split(",") if at else []:
            key, _, value = item.partition("=")
            try:
                if key in ("tp", "pp"):
                    setattr(spec, key, int(value))
                elif key == "devices":
                    spec.devices = [int(d) for d in value.split("+")]
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"cannot read {item!r} in {text!r}: the layout after '@' is tp=N, pp=N and "
                                 "devices=A+B+... separated by commas") from None
        return spec

    @property
    def world(self) -> int:
        """Devices its placement needs: one more than the highest device index."""
        return max(self.devices) + 1 if self.devices else self.tp * self.pp


@dataclass
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gpu_memory_budget: int | None = None  # bytes for weights + KV cache + workspace; None: 90% of the device
    workspace_bytes: int | None = None  # reserved for activations; None: a tenth of the budget, at most 2 GiB
    policy: str = "default"  # default | preempt | slo | computron
    executor: str | None = None  # inprocess | legacy | workers (one worker process per device); None: legacy for the computron policy, else inprocess
    devices: int = 1  # executor "workers": devices, one worker process each (models spread over them by placement)
    max_batch_size: int = 32
    max_tokens_per_step: int = 2048
    max_loaded: int = 1  # computron policy: models resident at once
    kv_block_tokens: int = 16  # tokens per block of the paged KV cache
    cuda_graphs: bool = True  # replay each model's decode step as a CUDA graph (GPU only)
    prefetch: bool = True
    # Models whose batches one step runs together on a device (each its own batch: their weights
    # differ). 1: a device steps one model at a time. Several decode steps of small batches overlap on a
    # GPU when they run at once (bench/concurrent_steps.py).
    models_per_step: int = 1
    max_wait_s: float = 1.0  # preempt policy: a request kept waiting this long by others' running requests preempts them
    # preempt policy: stopped requests keep their KV cache on the device while it fits, instead of
    # recomputing it (off by default: measured worse in the simulator's hot/cold sweep, docs/engine.md)
    preempt_keeps_kv: bool = False
    # preempt (with preempt_keeps_kv) and slo policies: host bytes the KV blocks of stopped requests may
    # take when their device memory is needed (moved to pinned host memory and back, not recomputed);
    # 0: off, a stopped request keeps its blocks on the device or recomputes them
    kv_host_bytes: int = 0
    # slo policy: each model's SLO, {model: {"ttft_s": seconds, "tpot_s": seconds}}; a model not named
    # gets slo_scale times its solo figures, from the cost model of slo_calibration (a built-in
    # calibration's name or a file of `computron bench calibrate`; None: the built-in one of the
    # device kind, "cpu" on the CPU, else "h200-rough")
    slos: dict = field(default_factory=dict)
    slo_scale: float = 5.0
    slo_calibration: str | None = None
    # A steady decode batch runs up to this many steps per call, each step's tokens fed to the next on
    # the device (one wait for the device per run); a request arriving meanwhile waits for the run's end.
    decode_steps: int = 1
    # executor "workers": a worker starts the next decode step of a steady batch before the engine asks
    # for it, hiding the control channel's round trip (engine/ahead.py); executor "inprocess" on a CUDA
    # GPU: the next step is queued before this one's tokens are read back, so the GPU does not idle while
    # the host plans. Outputs are the same either way.
    run_ahead: bool = True
    # executor "workers" over several nodes: take workers of other nodes at HOST:PORT (they connect
    # with `computron worker --connect`, authenticated by $COMPUTRON_WORKER_AUTHKEY) and start only the
    # workers of devices 0 .. local_devices - 1 here. None: $COMPUTRON_WORKERS_LISTEN and
    # $COMPUTRON_LOCAL_DEVICES, else every device is this node's.
    workers_listen: str | None = None
    local_devices: int | None = None
    # Striped swap-in (memory/striped.py): GPUs whose host links the loads of one-device models also
    # pull through, each lending two chunks of staging while it helps. Executor "inprocess": GPUs this
    # engine does not otherwise use (their links are idle), every load. Executor "workers": devices of
    # the engine, lent by the scheduler to a load only while they have no load of their own in flight.
    stripe_devices: list[int] = field(default_factory=list)
    stripe_chunk_bytes: int | str = 32 * 2**20  # bytes a link moves at a time (32 MiB measured best)

    def __post_init__(self) -> None:
        if not isinstance(self.models_per_step, int) or self.models_per_step < 1:
            raise ValueError(f"models_per_step must be an integer of at least 1, got {self.models_per_step!r}")
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= 64:
            raise ValueError(f"decode_steps must be an integer from 1 to 64, got {self.decode_steps!r}")
        self.gpu_memory_budget = parse_bytes(self.gpu_memory_budget)
        self.workspace_bytes = parse_bytes(self.workspace_bytes)
        self.kv_host_bytes = parse_bytes(self.kv_host_bytes)  # "8GiB" in a file as on the command line
        check_stripe_devices(self.stripe_devices)
        self.stripe_chunk_bytes = parse_bytes(self.stripe_chunk_bytes)
        if not isinstance(self.stripe_chunk_bytes, int) or self.stripe_chunk_bytes < 1:
            raise ValueError(f"stripe_chunk_bytes must be a positive number of bytes, got {self.stripe_chunk_bytes!r}")


def parse_stripe_devices(text: str) -> list[int]:
    """``--stripe-devices I,J,...`` (serve, sim) as checked device indexes."""
    try:
        return check_stripe_devices([int(x) for x in text.split(",")])
    except ValueError:
        raise ValueError(f"--stripe-devices takes distinct device indexes separated by commas, got {text!r}") from None


def check_stripe_devices(devices) -> list[int]:
    if not isinstance(devices, list) or len(set(devices)) != len(devices) or \
            not all(isinstance(d, int) and d >= 0 for d in devices):
        raise ValueError(f"stripe_devices must be distinct device indexes, got {devices!r}")
    return devices


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256  # per model; beyond it requests get 429
    model_dirs: list[str] = field(default_factory=list)  # checkpoints registered at run time must lie here
    admin_key: str | None = None  # the admin routes need it; without one they are off
    max_body_bytes: int | str = "8MiB"  # larger request bodies get 413 before they are parsed
    host_memory_budget: int | str | None = None  # host bytes of all models; default: 80% of the machine's memory

    def __post_init__(self) -> None:
        self.max_body_bytes = parse_bytes(self.max_body_bytes)
        self.host_memory_budget = parse_bytes(self.host_memory_budget)


@dataclass
class ComputronConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    models: list[ModelSpec] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ComputronConfig":
        data = dict(data or {})
        unknown = set(data) - {"engine", "server", "models"}
        if unknown:
            raise ValueError(f"unknown config section(s): {', '.join(sorted(unknown))} (engine, server, models)")
        models = []
        for m in data.get("models") or []:
            models.append(ModelSpec.parse(m) if isinstance(m, str) else _build(ModelSpec, m, "models[]"))
        return cls(engine=_build(EngineConfig, data.get("engine") or {}, "engine"),
                   server=_build(ServerConfig, data.get("server") or {}, "server"), models=models)


def _build(kind, values: dict, where: str):
    if not isinstance(values, dict):
        raise ValueError(f"config section {where} must be a mapping, got {type(values).__name__}")
    names = {f.name for f in fields(kind)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
    return kind(**values)


def load_config(path: str | Path | None) -> ComputronConfig:
    if path is None:
        return ComputronConfig()
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist")
    return ComputronConfig.from_dict(yaml.safe_load(p.read_text()) or {})
