"""LegacyExecutor: the original Computron's swap mechanics, kept to compare against.

Weights are kept per parameter, in ordinary (pageable) host memory until the first eviction;
a load copies them parameter by parameter on a load stream and finishes before compute starts;
an eviction copies every weight back to the host (pinned from then on). Device weights live in
PyTorch's allocator, outside the arena, which holds only the KV caches. Everything else (KV
caches, batches, sampling) is the in-process executor's.
"""

from __future__ import annotations

import torch

from ..memory.swapper import LegacySwapper
from .inprocess import InProcessExecutor, _Model, _Resident


class LegacyExecutor(InProcessExecutor):
    pin_images = False  # the original started from pageable host memory
    stripes = False  # and copied through one link
    fixed_weights = False  # every load lands wherever PyTorch's allocator puts it

    def __init__(self, config, index: int = 0, world: int = 1):
        super().__init__(config, index, world)
        self.legacy = LegacySwapper(self.device)
        self.host: dict[str, dict[str, torch.Tensor]] = {}
        self.on_device: dict[str, dict[str, torch.Tensor]] = {}

    def _keep_image(self, name: str, model: _Model) -> None:
        self.host[name] = dict(model.image.views)  # the image lives on through its views until replaced
        model.image = None

    def unregister(self, name: str) -> None:
        super().unregister(name)
        self.host.pop(name, None)

    def _load(self, name: str, helpers: tuple[int, ...] = ()) -> None:
        if helpers:
            raise ValueError(f"model {name!r}: the legacy executor copies through one link; it cannot load "
                             f"striped through devices {list(helpers)}")
        dev, swap = self.legacy.swap_in(self.host[name])
        self.on_device[name] = dev
        self.models[name].runner.bind(id(dev), dev)
        self.resident[name] = _Resident(None, swap)

    def _evict(self, name: str) -> None:
        self.resident.pop(name)
        self.models[name].runner.unbind()
        self.host[name] = self.legacy.swap_out(self.on_device.pop(name))

    def _bind(self, name: str) -> None:
        """Bound at load: these weights never move."""

    def status(self):
        st = super().status()
        st.devices[0].weights += sum(t.nbytes for dev in self.on_device.values() for t in dev.values())
        return st

    def probe_link(self, name: str, repeats: int) -> list[float]:
        raise ValueError("the legacy executor keeps no flat host image to probe the link with")
