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
from ..models.transformer import TORCH_DTYPES, AttnBatch, DecoderLM, bind_weights, rope_tables


class ModelRunner:
    """``links`` (pipeline parallel): a later stage receives its input from the previous stage and
    an earlier one sends its output on (``parallel.collectives.StageLinks``); only the last stage
    returns logits."""

    def __init__(self, cfg: ModelConfig, model: DecoderLM | None = None, links=None):
        self.cfg = cfg
        self.model = model if model is not None else DecoderLM(cfg)
        self.links = links
        self.dtype = TORCH_DTYPES[cfg.dtype]
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
                swap: SwapIn | None = None, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [num_seqs, vocab] of each sequence's last new token, or of the flat batch's ``rows``
        (None on a stage before the last)."""
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
            batch.rope = rope_tables(self.cfg, positions, self.dtype)
        if m.first:
            x = m.embed(ids, positions)
        else:
            x = self.links.recv(ids.shape[0], self.cfg.hidden_size, self.dtype, ids.device)
        for i, layer in enumerate(m.layers):
            wait(i + 1)
            x = layer(x, batch)
        wait(len(m.layers) + 1)
        if not m.last:
            self.links.send(x)
            return None
        return m.head(x.index_select(0, batch.last if rows is None else rows))
