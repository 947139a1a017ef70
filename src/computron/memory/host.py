"""HostImage: one contiguous (pinned, when a GPU is present) host buffer holding a model's weights.

Under the worker executor with striped swap-ins the buffer is a file of shared memory that helper
workers map too (``memory/shared.py``, ``map_shared``): one copy of the image for every process.

Built once, at registration; never written again while serving (weights are immutable), so a
swap-out copies nothing back. Parameters are views into it. A preset's random weights are
generated straight into the image parameter by parameter (on the GPU when there is one, which
is much faster than the CPU's generator), so no transient full copy of the model ever exists.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
import weakref
import zlib

import torch

from . import shared

from ..models.config import ModelConfig
from ..models.transformer import init_std
from .layout import WeightLayout


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the pages are mapped read-only (a helper's view)


HUGE_PAGE = 2 * 2**20
HUGE_PAGES_ENV = "COMPUTRON_HOST_HUGE_PAGES"


def huge_pages_default() -> bool:
    """Whether host images ask for transparent huge pages: ``$COMPUTRON_HOST_HUGE_PAGES`` (1/0), off
    by default. Several GPUs copying at once from 4 KiB pages found one 26 GB image 10% slower than
    another (bench/load_gap.py); 2 MiB pages are the candidate cure, off until measured."""
    value = os.environ.get(HUGE_PAGES_ENV, "0").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"${HUGE_PAGES_ENV} must be 1 or 0 (or true/false, yes/no, on/off), got {value!r}")
    return value in ("1", "true", "yes", "on")


def host_buffer(nbytes: int, pin: bool, huge: bool | None = None) -> torch.Tensor:
    """A flat uint8 host buffer; page-locked when ``pin`` so copies to the GPU run at full speed.

    Pinning registers an ordinary allocation with CUDA rather than taking memory from PyTorch's
    pinned-memory cache: that cache rounds each block up to a power of two (a 26 GB model would
    hold 32 GB) and keeps freed blocks for itself, so unregistered models would never give their
    memory back to the system. The registration ends when the buffer is garbage collected.

    ``huge`` (default :func:`huge_pages_default`): fresh anonymous memory aligned to 2 MiB and
    advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``; the kernel gives them where its
    setting is ``madvise`` or ``always`` and it has them), so a copy engine walks a few large pages
    rather than many small ones.
    """
    if huge is None:
        huge = huge_pages_default()
    buf = _huge_buffer(nbytes) if huge and nbytes >= HUGE_PAGE else torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        _pin(buf)
    return buf


def _huge_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory starting on a 2 MiB boundary, advised for huge pages (the
    tensor keeps the mapping alive)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem: its own huge-page rules
    anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address; released before the view is made
    off = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE, off, size)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=off)


def _pin(buf: torch.Tensor, flags: int = _HOST_REGISTER_PORTABLE, must: bool = True) -> bool:
    """Page-lock ``buf``'s memory until its storage is collected; False (only when not ``must``) if
    CUDA refused."""
    cudart = torch.cuda.cudart()
    # portable: page-locked for every GPU's copies, not only the current one's (a striped swap
    # pulls one image through several GPUs' links)
    err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), flags)
    if int(err) != 0:
        if not must:
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:  # so that PyTorch's next launch check does not report it
                clear()
            return False
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed with CUDA error {int(err)}")
    weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
    return True


def _over(mapping, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the first ``nbytes`` of a memory mapping (kept alive by the tensor)."""
    with warnings.catch_warnings():  # a read-only mapping: PyTorch warns that it cannot forbid writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes) if nbytes else \
            torch.empty(0, dtype=torch.uint8)


def map_shared(path: str, nbytes: int, pin: bool) -> torch.Tensor:
    """Another worker's host image in shared memory (``memory/shared.py``), mapped read-only in this
    process, page-locked here too when ``pin`` (so this GPU's copies from it run at the link's speed)."""
    buf = _over(shared.attach(path, nbytes), nbytes)
    if pin and nbytes and not _pin(buf, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY, must=False):
        # a GPU that cannot page-lock read-only pages: map them writable (never written) and lock those
        buf = _over(shared.attach(path, nbytes, writable=True), nbytes)
        _pin(buf)
    return buf


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (its full-model name) of a preset seeded ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class HostImage:
    def __init__(self, layout: WeightLayout, pin: bool, shared_path: str | None = None, huge: bool | None = None):
        """``shared_path``: build the image in that new file of shared memory, so other workers can
        map it (``map_shared``: a striped swap-in's helpers); the file goes when the image does.
        ``huge``: ask for 2 MiB pages (``host_buffer``; not for a shared file, whose pages are tmpfs')."""
        self.layout = layout
        self.pinned = pin
        self.shared_path = shared_path
        if shared_path is None:
            self.buffer = host_buffer(layout.nbytes, pin, huge)
        else:
            self.buffer = _over(shared.create(shared_path, layout.nbytes), layout.nbytes)
            self._unlink = weakref.finalize(self, shared.remove, shared_path)
            if pin and layout.nbytes:
                _pin(self.buffer)
        self.views = layout.views(self.buffer)

    def drop_shared(self) -> None:
        """Remove the shared file now (the model is unregistered: its name may be taken again at once);
        the pages live on while this process or a helper still maps them."""
        if self.shared_path is not None:
            self._unlink()

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def fill_random(self, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> None:
        """Random weights from a fixed seed: each parameter gets its own generator keyed by its name,
        so the values do not depend on the order of generation (they do depend on the device kind)."""
        dev = torch.device(device)
        for name, view in self.views.items():
            std = init_std(name, cfg)
            if std is None:
                view.fill_(1.0)
                continue
            if std == 0.0:
                view.zero_()
                continue
            gen = torch.Generator(device=dev)
            gen.manual_seed(param_seed(seed, name))
            if dev.type == "cpu":
                view.normal_(0.0, std, generator=gen)
            else:
                tmp = torch.empty(view.shape, dtype=view.dtype, device=dev).normal_(0.0, std, generator=gen)
                view.copy_(tmp)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
