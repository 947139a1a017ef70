"""Giving back part of a CUDA device's cached memory: the stream-ordered pool trimmed to a size.

PyTorch's own caching allocator can only give back all it caches (``empty_cache``), and each
``cudaFree`` takes time in proportion to the bytes it unmaps (``bench/release_cost.py``: 0.4 to
1.0 ms per GB for blocks of 64 MB and more on an H200). Under
``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` PyTorch allocates from the device's default
stream-ordered memory pool instead, and CUDA can trim that pool down to a given size
(``cudaMemPoolTrimTo``), so a handover gives back what the demand needs and keeps the rest cached
for the next micro-batch. :func:`releaser` gives a colocated job's release: the pool trimmed to
what the job may keep under that backend, the whole cache emptied under the native one. CUDA
runtime calls through ctypes, on the ``libcudart`` that torch loaded.
"""

from __future__ import annotations

import ctypes

# cudaMemPoolAttr values (driver_types.h)
ATTR_RESERVED_MEM_CURRENT = 5
ATTR_USED_MEM_CURRENT = 7


def async_backend() -> bool:
    """Whether PyTorch allocates on CUDA through ``cudaMallocAsync`` in this process."""
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_allocator_backend() == "cudaMallocAsync"


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (a bare soname finds the library already in the process)."""
    import torch

    torch.cuda.init()
    major = (torch.version.cuda or "").split(".")[0]
    with open("/proc/self/maps") as f:
        loaded = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    for name in loaded + ([f"libcudart.so.{major}"] if major else []):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("no CUDA runtime library (libcudart) found in this process")


class DevicePool:
    """The default stream-ordered memory pool of one CUDA device (the one ``cudaMallocAsync`` uses)."""

    def __init__(self, device: int):
        self._rt = _cudart()
        self._pool = ctypes.c_void_p()
        self._check(self._rt.cudaDeviceGetDefaultMemPool(ctypes.byref(self._pool), ctypes.c_int(device)),
                    "cudaDeviceGetDefaultMemPool")

    def _check(self, err: int, what: str) -> None:
        if err:
            self._rt.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {self._rt.cudaGetErrorString(err).decode()} ({err})")

    def _attr(self, attr: int) -> int:
        v = ctypes.c_uint64()
        self._check(self._rt.cudaMemPoolGetAttribute(self._pool, ctypes.c_int(attr), ctypes.byref(v)),
                    "cudaMemPoolGetAttribute")
        return v.value

    @property
    def reserved(self) -> int:
        """Bytes the pool holds from the device (in use and cached)."""
        return self._attr(ATTR_RESERVED_MEM_CURRENT)

    @property
    def used(self) -> int:
        """Bytes of the pool in use by allocations."""
        return self._attr(ATTR_USED_MEM_CURRENT)

    def trim_to(self, keep: int) -> int:
        """Give back cached memory until the pool holds at most ``keep`` bytes, or holds only what is in use
        (or what work still queued may touch: drain the streams first). The bytes it holds after.

        CUDA gives back whole blocks and stops before the pool would hold less than it was asked to keep,
        so a pool of mixed blocks can stay a few MB above ``keep`` (12.5 MiB, trimming 2.45 GB off a cache of
        mixed sizes on an H200): then it is asked again, that much lower."""
        target = max(0, keep)
        for _ in range(4):
            self._check(self._rt.cudaMemPoolTrimTo(self._pool, ctypes.c_size_t(target)), "cudaMemPoolTrimTo")
            held = self.reserved
            if held <= keep or target == 0:
                return held
            target = max(0, target - (held - keep))
        return held


def releaser(device):
    """A colocated job's ``release(keep)`` on ``device`` (a ``torch.device``): give back cached memory so
    that the job holds at most ``keep`` bytes. Under ``cudaMallocAsync`` the pool is trimmed to ``keep``
    once the device's queued work (and the frees it orders) is done; under the native allocator its whole
    cache is emptied; on the CPU nothing is held."""
    import torch

    if device.type != "cuda":
        return lambda keep: None
    if not async_backend():
        return lambda keep: torch.cuda.empty_cache()
    index = device.index if device.index is not None else torch.cuda.current_device()
    pools: list[DevicePool] = []  # made at the first release: a job that never releases needs no pool

    def release(keep: int) -> None:
        if not pools:
            pools.append(DevicePool(index))
        torch.cuda.current_stream(device).synchronize()  # stream-ordered frees are releasable once reached
        pools[0].trim_to(keep)

    return release
