"""Device memory at a fixed address whose physical backing can be returned to the driver and taken
again: CUDA's virtual memory management (driver API, through ctypes; no extra dependency).

A ``Reservation`` reserves a virtual address range as large as the arena may ever be and maps
physical memory into it from its start, in fixed chunks, up to what the arena may use now.
Shrinking unmaps and releases the chunks past the new end (the driver can hand them to anyone:
a training job's caching allocator); growing maps new ones. The range never moves, so tensors
viewing it (the arena's buffer, the KV pool, CUDA graphs that baked its addresses in) stay valid;
only bytes past the mapped end must never be touched, which the arena guarantees.
"""

from __future__ import annotations

import ctypes
import threading

import torch

CHUNK = 64 * 2**20  # bytes mapped or released at a time (a multiple of the driver's granularity)

_ALLOC_PINNED, _LOC_DEVICE, _ACCESS_RW, _GRAN_MIN = 1, 1, 3, 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib = None
_lib_lock = threading.Lock()


def _driver():
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, size = ctypes.c_uint64, ctypes.c_size_t
            lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size, size, u64, u64]
            lib.cuMemAddressFree.argtypes = [u64, size]
            lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocProp), u64]
            lib.cuMemRelease.argtypes = [u64]
            lib.cuMemMap.argtypes = [u64, size, size, u64, u64]
            lib.cuMemUnmap.argtypes = [u64, size]
            lib.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(_AccessDesc), size]
            lib.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size), ctypes.POINTER(_AllocProp), ctypes.c_int]
            _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        try:
            _driver().cuGetErrorName(rc, ctypes.byref(name))
        except Exception:  # noqa: BLE001 -- the code alone still says what failed
            pass
        raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")


class _View:
    """A CUDA array interface over a raw device range, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class Reservation:
    def __init__(self, device: torch.device, max_bytes: int, chunk: int = CHUNK):
        self.device = device
        torch.cuda.synchronize(device)  # the device's primary context is current on this thread
        lib = _driver()
        self._prop = _AllocProp(type=_ALLOC_PINNED, location=_Location(_LOC_DEVICE, device.index or 0))
        gran = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop), _GRAN_MIN),
               "cuMemGetAllocationGranularity")
        self.chunk = -(-chunk // gran.value) * gran.value
        self.max_bytes = -(-max_bytes // self.chunk) * self.chunk
        ptr = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self.max_bytes, 0, 0, 0), "cuMemAddressReserve")
        self.ptr = ptr.value
        self._handles: list[int] = []  # chunk i is mapped at ptr + i * chunk
        self._access = [_AccessDesc(location=_Location(_LOC_DEVICE, device.index or 0), flags=_ACCESS_RW)]
        self.map_to(self.chunk)  # torch asks the driver about the pointer: it must be backed
        with torch.cuda.device(device):
            self.tensor = torch.as_tensor(_View(self.ptr, max_bytes), device=device)

    @property
    def mapped(self) -> int:
        return len(self._handles) * self.chunk

    def map_to(self, nbytes: int) -> int:
        """Physical memory behind the first ``nbytes`` (rounded up to whole chunks) and no more;
        returns the bytes mapped. The caller makes sure nothing past ``nbytes`` is in use."""
        lib = _driver()
        want = min(-(-max(nbytes, 0) // self.chunk), self.max_bytes // self.chunk)
        if want < len(self._handles):
            torch.cuda.synchronize(self.device)  # no kernel or copy may still touch what goes away
        while len(self._handles) > want:
            at = self.ptr + (len(self._handles) - 1) * self.chunk
            _check(lib.cuMemUnmap(at, self.chunk), "cuMemUnmap")
            _check(lib.cuMemRelease(self._handles.pop()), "cuMemRelease")
        while len(self._handles) < want:
            handle = ctypes.c_uint64()
            _check(lib.cuMemCreate(ctypes.byref(handle), self.chunk, ctypes.byref(self._prop), 0),
                   f"cuMemCreate of {self.chunk} bytes (device out of memory?)")
            at = self.ptr + len(self._handles) * self.chunk
            try:
                _check(lib.cuMemMap(at, self.chunk, 0, handle.value, 0), "cuMemMap")
                self._set_access(at, self.chunk)
            except RuntimeError:
                lib.cuMemUnmap(at, self.chunk)
                lib.cuMemRelease(handle.value)
                raise
            self._handles.append(handle.value)
        return self.mapped

    def grant(self, peer: torch.device) -> None:
        """Let another GPU read and write the range (its copy engines push into it: a striped swap's
        peer copies). Chunks mapped later get the same access."""
        if any(a.location.id == (peer.index or 0) for a in self._access):
            return
        self._access.append(_AccessDesc(location=_Location(_LOC_DEVICE, peer.index or 0), flags=_ACCESS_RW))
        for i in range(len(self._handles)):
            self._set_access(self.ptr + i * self.chunk, self.chunk)

    def _set_access(self, at: int, nbytes: int) -> None:
        descs = (_AccessDesc * len(self._access))(*self._access)
        _check(_driver().cuMemSetAccess(at, nbytes, descs, len(self._access)), "cuMemSetAccess")

    def close(self) -> None:
        if self.ptr:
            self.map_to(0)
            _driver().cuMemAddressFree(self.ptr, self.max_bytes)
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the driver may be gone
            pass


def reserve(device: torch.device, max_bytes: int) -> Reservation | None:
    """A reservation on a CUDA device, or None where the driver's virtual memory management
    cannot be used (then the arena holds a plain allocation and cannot return memory)."""
    try:
        return Reservation(device, max_bytes)
    except (OSError, AttributeError, RuntimeError):
        return None
