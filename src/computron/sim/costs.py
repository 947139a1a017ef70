"""What the simulator charges for each thing the engine does: a ``Calibration`` and pure cost functions.

Every time is a simple affine model with a floor (no torch, no I/O except ``load``/``save``):

- **swap-in**: ``bytes / swap_bandwidth[device]`` (one copy stream per device: loads on one
  device run one after another, each layer group landing in turn); the legacy executor of the
  ``computron`` policy copies from pageable host memory until a model's first eviction, at
  ``pageable_swap_bandwidth`` (0: as ``swap_bandwidth``, the rate from page-locked memory);
- **prefill** of ``t`` tokens on a model of ``B`` weight bytes (one rank's shard):
  ``max(B / hbm_bandwidth, prefill_fixed_s + prefill_fixed_s_per_byte * B + t * (prefill_token_s +
  prefill_token_s_per_byte * B))``;
- **decode** step of ``b`` sequences: ``max(B / hbm_bandwidth, decode_fixed_s + decode_fixed_s_per_byte * B
  + b * (decode_seq_s + decode_seq_s_per_byte * B))`` (the per-byte fixed term: reading the weights);
- the **server's per-stream cost**: every sequence of a batch that makes a token (decode or the prompt's
  first token) adds ``server_seq_s`` (detokenising, the SSE event, the chunk written, the queue hop:
  work on the server's thread that shares the engine's process); 0 in a calibration of the engine
  alone or one that has it folded into ``decode_seq_s`` (``bench calibrate --serve``), and in files
  written before the field existed;
- a **mixed** batch (prompts and decodes in one step) pays the prefill fixed cost and both sums;
- **eviction**: ``evict_s + evict_s_per_byte * B`` (the default executor copies nothing back: the
  region is released; the legacy executor of the ``computron`` policy copies the weights back to
  the host, which a calibration of that executor measures as a per-byte term). The legacy copy
  back lands in page-locked host memory, allocated anew unless a host copy freed earlier is there
  to reuse (PyTorch caches freed page-locked blocks): the bytes allocated cost
  ``evict_pin_s_per_byte`` more (a model's first evictions; 0 for other executors);
- a **decode graph captured** after a load: ``graph_capture_s + graph_capture_s_per_byte * B``, added to
  the first decode step of each batch-size bucket (``engine/buckets.py``) after each load of the model. The
  executor keeps a model's graphs only while its weights stay at one address, and a model swapped back
  in usually lands elsewhere; 0 (no graphs) in a calibration of the CPU, of the legacy executor, and in
  files written before the field existed. The first capture of a bucket for a model also runs its
  kernels twice first, compiling and tuning them: ``graph_warmup_s + graph_warmup_s_per_byte * B`` more,
  once per bucket and model (0 in files written before the field existed).

The weight-read floor ``B / hbm_bandwidth`` is the least any step can take: every weight is read once.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .timing import batch_time, pipelined_finish  # noqa: F401  (compiled with the simulator; for every caller)


@dataclass(frozen=True)
class Calibration:
    name: str = "cpu-default"
    swap_bandwidth: tuple[float, ...] = (8e9,)  # bytes/s host→device per device; one value: every device
    hbm_bandwidth: float = 20e9  # bytes/s the device reads its weights at (the floor of every step)
    prefill_fixed_s: float = 1e-3  # per batch with at least one prompt
    prefill_token_s: float = 2e-5  # per prompt token
    prefill_token_s_per_byte: float = 5e-12  # per prompt token per weight byte (≈ 2 FLOP/param at the FLOP rate)
    decode_fixed_s: float = 5e-4  # per decode-only batch
    decode_seq_s: float = 2e-5  # per sequence of the batch
    decode_seq_s_per_byte: float = 5e-12  # per sequence per weight byte
    evict_s: float = 1e-5  # per eviction
    prefill_fixed_s_per_byte: float = 0.0  # per batch with a prompt, per weight byte
    decode_fixed_s_per_byte: float = 0.0  # per decode-only batch, per weight byte (the weights read once)
    evict_s_per_byte: float = 0.0  # per eviction, per weight byte (an executor that copies weights back)
    device_memory: int = 2 * 2**30  # bytes per device when the engine config sets no budget (the CPU default)
    server_seq_s: float = 0.0  # per sequence that makes a token in a step: the server's streaming work
    graph_capture_s: float = 0.0  # per decode graph captured after a load (the first step of a bucket)
    graph_capture_s_per_byte: float = 0.0  # the same, per weight byte (a deeper model records more kernels)
    graph_warmup_s: float = 0.0  # more for a model's first capture of a bucket: its kernels run twice first
    graph_warmup_s_per_byte: float = 0.0
    # legacy executor: bytes/s of a swap-in from pageable host memory (a model's loads before its first
    # eviction; 0: as swap_bandwidth), and seconds per byte of page-locked host memory an eviction allocates
    pageable_swap_bandwidth: float = 0.0
    evict_pin_s_per_byte: float = 0.0
    # bytes/s the host side moves over all links at once (0: no limit beyond the links' own): a striped
    # swap-in (stripe_devices) pulls through several links, which four H200s did at 3.3x one link, not 4x
    host_bandwidth: float = 0.0
    # Batches of several models one step runs together on a device (models_per_step > 1): the longest
    # takes its own time and each other adds this fraction of its own. 1: one after another (the
    # in-process executor's order); an H200 stepping 2-6 OPT-1.3B decode graphs on separate streams
    # measured 0.30-0.42 (bench/concurrent_steps.py). The sum of their weight reads stays a floor.
    concurrent_step_fraction: float = 1.0

    def __post_init__(self) -> None:
        bw = self.swap_bandwidth
        if isinstance(bw, (int, float)) and not isinstance(bw, bool):
            bw = (float(bw),)
        if not isinstance(bw, (tuple, list)) or not bw:
            raise ValueError(f"calibration {self.name!r}: swap_bandwidth must be a number or a non-empty "
                             f"list of numbers (bytes/s per device), got {self.swap_bandwidth!r}")
        object.__setattr__(self, "swap_bandwidth", tuple(float(_number(self.name, "swap_bandwidth", b)) for b in bw))
        errors = []
        for f in fields(self):
            if f.name in ("name", "swap_bandwidth"):
                continue
            v = _number(self.name, f.name, getattr(self, f.name))
            if f.name in ("hbm_bandwidth", "device_memory") and not v > 0:
                errors.append(f"{f.name} must be positive, got {v!r}")
            elif not v >= 0:
                errors.append(f"{f.name} must be non-negative, got {v!r}")
        if not self.concurrent_step_fraction <= 1:
            errors.append(f"concurrent_step_fraction must be at most 1, got {self.concurrent_step_fraction!r}")
        if any(not b > 0 for b in self.swap_bandwidth):
            errors.append(f"swap_bandwidth must be positive, got {list(self.swap_bandwidth)}")
        if not isinstance(self.device_memory, int) or isinstance(self.device_memory, bool):
            errors.append(f"device_memory must be an integer number of bytes, got {self.device_memory!r}")
        if errors:
            raise ValueError(f"calibration {self.name!r}: " + "; ".join(errors))

    # ---- costs -------------------------------------------------------------------------------------
    def bandwidth(self, device: int) -> float:
        """Swap-in bytes/s of a device (the last value given serves every later device)."""
        bw = self.swap_bandwidth
        return bw[device] if device < len(bw) else bw[-1]

    def striped_bandwidth(self, devices) -> float:
        """Swap-in bytes/s through the links of ``devices`` at once (a striped swap-in: the model's own
        device and its helpers): their sum, capped by ``host_bandwidth`` when given."""
        total = sum(self.bandwidth(d) for d in devices)
        return min(total, self.host_bandwidth) if self.host_bandwidth else total

    def load_time(self, nbytes: int, device: int = 0, pageable: bool = False, helpers=()) -> float:
        """Seconds of a swap-in; ``pageable``: from pageable host memory (the legacy executor's first
        loads); ``helpers``: devices whose links it also pulls through (striped)."""
        if pageable and self.pageable_swap_bandwidth:
            return swap_time(nbytes, self.pageable_swap_bandwidth)
        return swap_time(nbytes, self.striped_bandwidth((device, *helpers)) if helpers else self.bandwidth(device))

    def together(self, times: list[float], weight_bytes: int) -> float:
        """Seconds of batches that run at once on one device, ``times`` each alone, reading
        ``weight_bytes`` of weights between them: the longest, plus ``concurrent_step_fraction`` of each
        other, and never less than reading all their weights."""
        longest = max(times)
        t = longest + self.concurrent_step_fraction * (sum(times) - longest)
        floor = weight_bytes / self.hbm_bandwidth
        return t if t > floor else floor

    def weight_read_time(self, nbytes: int) -> float:
        return nbytes / self.hbm_bandwidth

    def prefill_time(self, nbytes: int, tokens: int) -> float:
        return self.batch_time(nbytes, tokens, 0)

    def decode_time(self, nbytes: int, batch: int) -> float:
        return self.batch_time(nbytes, 0, batch)

    def batch_time(self, nbytes: int, prefill_tokens: int, decode_seqs: int, prefill_seqs: int | None = None) -> float:
        return batch_time(self, nbytes, prefill_tokens, decode_seqs, prefill_seqs)

    # ---- files ---------------------------------------------------------------------------------
    def capture_time(self, nbytes: int, first: bool = False) -> float:
        """Seconds of capturing a decode graph (``first``: the model's first of that bucket, warm-up included)."""
        t = self.graph_capture_s + self.graph_capture_s_per_byte * nbytes
        return t + self.graph_warmup_s + self.graph_warmup_s_per_byte * nbytes if first else t

    def to_dict(self) -> dict:
        d = asdict(self)
        d["swap_bandwidth"] = list(self.swap_bandwidth)
        return d

    @classmethod
    def from_dict(cls, data, where: str = "calibration") -> "Calibration":
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object of calibration fields, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"calibration file {p} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration file {p} is not valid JSON: {e.msg} at line {e.lineno}, "
                             f"column {e.colno}") from None
        return cls.from_dict(data, where=f"calibration file {p}")


def _number(cal: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"calibration {cal!r}: {name} must be a finite number, got {v!r}")
    return v


CPU_DEFAULT = Calibration()


# ---- the models, as pure functions -------------------------------------------------------------
def swap_time(nbytes: int, bandwidth: float) -> float:
    """Seconds to copy ``nbytes`` host→device at ``bandwidth`` bytes/s."""
    return nbytes / bandwidth


# Swap bandwidth and weight-read rate of the H200 measurements in the README; compute terms roughly
# fitted to its decode table (OPT-1.3B and Llama-3-8B, batch 1 to 128). A rough stand-in until a
# calibration measured on the GPU at hand is given.
H200_ROUGH = Calibration(name="h200-rough", swap_bandwidth=(55.2e9,), hbm_bandwidth=4.2e12, prefill_fixed_s=2e-3,
                         prefill_token_s=2e-6, prefill_token_s_per_byte=1.5e-15, decode_fixed_s=1.2e-3,
                         decode_seq_s=3.5e-5, decode_seq_s_per_byte=0.0, evict_s=3e-5, device_memory=140 * 2**30)
BUILT_IN = {"cpu": CPU_DEFAULT, "h200-rough": H200_ROUGH}


def calibration(name_or_file: str) -> Calibration:
    """A built-in calibration by name, or one read from a JSON file."""
    return BUILT_IN[name_or_file] if name_or_file in BUILT_IN else Calibration.load(name_or_file)
