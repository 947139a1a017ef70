"""HostImage: one contiguous (pinned, when a GPU is present) host buffer holding a model's weights.

Built once, at registration; never written again while serving (weights are immutable), so a
swap-out copies nothing back. Parameters are views into it. A preset's random weights are
generated straight into the image parameter by parameter (on the GPU when there is one, which
is much faster than the CPU's generator), so no transient full copy of the model ever exists.
"""

from __future__ import annotations

import weakref
import zlib

import torch

from ..models.config import ModelConfig
from ..models.transformer import init_std
from .layout import WeightLayout


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat uint8 host buffer; page-locked when ``pin`` so copies to the GPU run at full speed.

    Pinning registers an ordinary allocation with CUDA rather than taking memory from PyTorch's
    pinned-memory cache: that cache rounds each block up to a power of two (a 26 GB model would
    hold 32 GB) and keeps freed blocks for itself, so unregistered models would never give their
    memory back to the system. The registration ends when the buffer is garbage collected.
    """
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        cudart = torch.cuda.cudart()
        # portable: page-locked for every GPU's copies, not only the current one's (a striped swap
        # pulls one image through several GPUs' links)
        err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
    return buf


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (its full-model name) of a preset seeded ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class HostImage:
    def __init__(self, layout: WeightLayout, pin: bool):
        self.layout = layout
        self.pinned = pin
        self.buffer = host_buffer(layout.nbytes, pin)
        self.views = layout.views(self.buffer)

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
