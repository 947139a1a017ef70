"""The executor protocol: the only way the engine core reaches the devices.

An executor owns everything that holds tensors (host images, device arenas, swappers, KV caches,
model runners) and is spoken to with the messages of ``computron.messages`` alone. Nobody reads
an executor's attributes: a worker-per-GPU executor or a simulated one fits behind the same calls.

Implementations: ``InProcessExecutor`` (every model on one device of this process, the default; on
a CUDA GPU with ``run_ahead``, the ``RunAheadExecutor``: the same, plus the next decode step queued early),
``LegacyExecutor`` (the original Computron's swap mechanics, for comparison), ``WorkerExecutor``
(the in-process executor served by a worker process per device, restarted if it dies). This module does
not import torch; ``make_executor`` imports the chosen implementation.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Protocol

from ..messages import ExecuteBatch, ExecutorStatus, ModelDescription, ModelInfo, Residency, StepResult

EXECUTORS = ("inprocess", "legacy", "workers")


def check_stripe(name: str, devices: tuple[int, ...], helpers: tuple[int, ...], stripe) -> None:
    """Refuse a striped load (``Residency.stripes``) that cannot be: the model must be on one device
    (each rank of a sharded model loads its shard over its own link) and its helpers stripe devices
    other than it. Checked before any worker starts its part, so no helper sends what nobody receives."""
    if len(devices) != 1:
        raise ValueError(f"model {name!r} cannot be loaded striped through devices {list(helpers)}: only a model "
                         f"on one device is (each rank of a sharded model loads its shard over its own link)")
    bad = [h for h in helpers if h == devices[0] or h not in stripe]
    if bad or len(set(helpers)) != len(helpers):
        raise ValueError(f"model {name!r}: devices {bad or list(helpers)} are not distinct stripe devices that may "
                         f"help device {devices[0]} (stripe_devices: {list(stripe)})")


class Executor(Protocol):
    def register(self, desc: ModelDescription, progress: Callable[[str], None] | None = None) -> ModelInfo:
        """Build the model's host image (each rank its own shard). Slow; may run on another thread
        while the engine steps. Raises ValueError (bad model) or MemoryError-like errors with a reason."""

    def unregister(self, name: str) -> None:
        """Forget a model (evicting it first) and release its host image."""

    def apply(self, change: Residency) -> dict[str, float]:
        """Evict, then start loads (striped through the helpers ``change.stripes`` names, where the
        executor can: ``check_stripe``); returns seconds each eviction took (it waits for copies in flight)."""

    def execute(self, batches: list[ExecuteBatch]) -> Future[StepResult]:
        """Run one step of each batch (batches use disjoint devices); the future holds the tokens,
        loads that completed, requests that failed and devices that were lost."""

    def wait_loads(self) -> dict[str, float]:
        """Wait for every copy in flight; seconds of each load that ended and was not reported yet."""

    def free(self, req_ids: list[str]) -> None:
        """Release the KV caches of requests that ended."""

    def status(self) -> ExecutorStatus:
        """Devices (capacity and what is in use) and which models are resident or still loading."""

    def resize(self, device: int, nbytes: int) -> int:
        """Let the arena of ``device`` hold ``nbytes`` from now on (weights and KV cache), returning
        the memory past it to the device where it can (colocation); never below what is in use
        (compacted). Returns the arena's new size."""

    def probe_link(self, name: str, repeats: int) -> list[float]:
        """Seconds of a raw pinned host-to-device copy of ``name``'s image bytes on every rank at once,
        into free device memory (the reference a swap is measured against)."""

    def shutdown(self) -> None:
        """Release devices and stop workers."""


def executor_kind(kind: str | None, policy: str) -> str:
    """The executor a configuration asks for: the ``computron`` policy implies its legacy mechanics."""
    kind = kind or ("legacy" if policy == "computron" else "inprocess")
    if kind not in EXECUTORS:
        raise ValueError(f"unknown executor {kind!r}; choose one of {', '.join(EXECUTORS)}")
    return kind


def make_executor(config) -> Executor:
    """The executor for an ``EngineConfig``."""
    kind = executor_kind(config.executor, config.policy)
    if kind == "legacy":
        from .legacy import LegacyExecutor

        return LegacyExecutor(config)
    if kind == "workers":
        from .workers import WorkerExecutor

        return WorkerExecutor(config)
    from .inprocess import InProcessExecutor, pick_device

    if getattr(config, "run_ahead", False) and pick_device(config.device).type == "cuda":
        # the next decode step queued on the GPU before this one's tokens are read back (engine/ahead.py);
        # on the CPU starting a step computes it: nothing to gain
        from .ahead import RunAheadExecutor

        return RunAheadExecutor(config)
    return InProcessExecutor(config)
