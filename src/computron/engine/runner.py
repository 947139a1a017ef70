"""ModelRunner: one model's forward pass over a flat batch, layer by layer, on the serving device.

It owns a meta-device ``DecoderLM`` whose parameters are re-bound (as views, no copies) each
time the weights land somewhere new: after a swap-in, or after the arena compacts. Before
layer group *i* it waits for that group's swap-in event, so compute on the first layers
overlaps the copy of later ones.
"""

from __future__ import annotations

import torch

from ..memory.swapper import SwapIn
from ..models.config import ModelConfig
from ..models.transformer import AttnBatch, DecoderLM, bind_weights, rope_tables


class ModelRunner:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.model = DecoderLM(cfg)
        self._bound_key: object = None
        self.trace: list | None = None  # set to a list to record a CUDA event as each group's compute starts

    def bind(self, key: object, tensors) -> None:
        """Bind weights (a dict of tensors, or a function making one); ``key`` identifies where they
        live, so re-binding the same place costs nothing."""
        if key != self._bound_key:
            bind_weights(self.model, tensors() if callable(tensors) else tensors)
            self._bound_key = key

    def unbind(self) -> None:
        self._bound_key = None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                swap: SwapIn | None = None) -> torch.Tensor:
        """Logits [num_seqs, vocab] of each sequence's last new token."""
        m = self.model

        def wait(group: int) -> None:
            if swap is not None:
                swap.wait(group)
            if self.trace is not None and ids.is_cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.trace.append(ev)

        wait(0)
        if self.cfg.position == "rope":
            batch.rope = rope_tables(self.cfg, positions, m.embed_tokens.dtype)
        x = m.embed(ids, positions)
        for i, layer in enumerate(m.layers):
            wait(i + 1)
            x = layer(x, batch)
        wait(len(m.layers) + 1)
        return m.head(x.index_select(0, batch.last))
