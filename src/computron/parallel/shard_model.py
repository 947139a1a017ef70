"""One rank's model: the shard's ``DecoderLM``, its weight layout, and a host image holding only its slices.

What flows through: a :class:`~computron.parallel.sharding.Shard` becomes a meta-device
``DecoderLM`` of the shard's config (its stage's layers, divided heads/MLP/vocabulary, embeddings
on the first stage only, head on the last only), its ``WeightLayout``, and a ``HostImage`` (host
memory; pinned when asked) filled with the shard's weights, either

- a preset's random weights: each full parameter is generated exactly as
  ``HostImage.fill_random`` generates it (same per-name seed), one parameter at a time, and cut,
  so every layout (tp=1 included) sees the same model; or
- a Hugging Face safetensors checkpoint: each tensor is opened lazily (``safe_open().get_slice``)
  and only the rows/columns of this rank's cut are indexed, so a rank never reads the whole tensor.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from ..memory.host import HostImage, param_seed
from ..memory.layout import WeightLayout
from ..models import checkpoint as ckpt
from ..models.checkpoint import CheckpointError, Piece
from ..models.config import ModelConfig
from ..models.transformer import TORCH_DTYPES, DecoderLM, bind_weights, init_std
from .dims import ParallelDims
from .sharding import Cut, Shard, cut_tensor, shard_for


def shard_model(shard: Shard) -> DecoderLM:
    """The shard's model on the meta device (weights bound later, as views)."""
    return DecoderLM(shard.config, first=shard.first, last=shard.last, vocab_start=shard.vocab[0])


def fill_random(image: HostImage, shard: Shard, seed: int, device: str | torch.device = "cpu") -> None:
    """The preset's random weights, cut: each full parameter generated as ``HostImage.fill_random``
    does (its own generator, seeded by its full name), then its slice copied into the image."""
    dev, full_cfg = torch.device(device), shard.full
    shapes = ckpt.expected_shapes(full_cfg)
    for name, view in image.views.items():
        g = shard.global_name(name)
        std, cut = init_std(g, full_cfg), shard.cut(name, shapes[g])
        if std is None or std == 0.0 or cut.zero:  # norm weights are ones, biases zeros
            view.fill_(1.0 if std is None else 0.0)
            continue
        gen = torch.Generator(device=dev)
        gen.manual_seed(param_seed(seed, g))
        full = torch.empty(shapes[g], dtype=view.dtype, device=dev).normal_(0.0, std, generator=gen)
        view.copy_(cut_tensor(full, cut))
        del full


class SliceReader:
    """Open safetensors files lazily and hand out slices (``get_slice``): nothing is read until indexed."""

    def __init__(self, stack: ExitStack):
        self.stack, self.handles = stack, {}

    def slice(self, file: Path, name: str):
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(ckpt._open(file))
        try:
            return self.handles[file].get_slice(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _read_piece(src, piece: Piece, cut: Cut, view: torch.Tensor, full: tuple[int, ...], where: str) -> None:
    """Copy the part of one checkpoint tensor (``piece``: rows [row, row + rows) of our full
    parameter) that ``cut`` keeps into ``view``, indexing only that part of ``src``."""
    shape = tuple(src.get_shape())
    want = (piece.rows, *full[1:])
    if shape != (want[::-1] if piece.transpose else want):
        raise CheckpointError(f"{where} has shape {list(shape)}, expected {list(want[::-1] if piece.transpose else want)}")
    p0, p1 = piece.row, piece.row + piece.rows
    offset = 0
    for a, b in cut.ranges:
        if cut.dim == 0:
            lo, hi = max(a, p0), min(b, p1)
            if lo < hi:
                t = src[:, lo - p0 : hi - p0].t() if piece.transpose else src[lo - p0 : hi - p0]
                view[offset + lo - a : offset + hi - a].copy_(t)
        else:  # column cut of every row of the piece (for GPT-2's Conv1D: rows of the stored [in, out])
            t = src[a:b, :].t() if piece.transpose else src[:, a:b]
            view[p0:p1, offset : offset + b - a].copy_(t)
        offset += b - a


def load_checkpoint(path: str | Path, image: HostImage, shard: Shard) -> None:
    """Fill the shard's image from a Hugging Face checkpoint, reading only the shard's slices."""
    path = Path(path).expanduser()
    shapes, tensors = ckpt.expected_shapes(shard.full), ckpt.tensor_files(path)
    with ExitStack() as stack:
        reader = SliceReader(stack)
        for name, view in image.views.items():
            g = shard.global_name(name)
            full = shapes[g]
            cut = shard.cut(name, full)
            view.zero_()  # padding rows, and the zero shards of row-parallel biases
            if cut.zero:
                continue
            for piece in ckpt.plan(shard.full, g, full[0]):
                if piece.source not in tensors:
                    raise CheckpointError(f"checkpoint {path} lacks tensor {piece.source!r} (needed for {g})")
                file, key = tensors[piece.source]
                src = reader.slice(file, key)
                if not src.get_dtype().startswith(("F", "BF")):
                    raise CheckpointError(f"tensor {key!r} in {file} has dtype {src.get_dtype()}; only float weights load")
                _read_piece(src, piece, cut, view, full, f"tensor {key!r} in {file}")


def build_rank(cfg: ModelConfig, dims: ParallelDims, rank: int, *, seed: int = 0, checkpoint: str | Path | None = None,
               partition: list[int] | None = None, pin: bool = False, device: str | torch.device = "cpu"):
    """(shard, model bound to its host image, image) of one rank: the weights from ``checkpoint`` when
    given, else the preset's random weights of ``seed``."""
    shard = shard_for(cfg, dims, rank, partition)
    model = shard_model(shard)
    image = HostImage(WeightLayout.of(model, TORCH_DTYPES[cfg.dtype]), pin)
    if checkpoint is not None:
        load_checkpoint(checkpoint, image, shard)
    else:
        fill_random(image, shard, seed, device)
    bind_weights(model, image.views)
    return shard, model, image


def rank_bytes(cfg: ModelConfig, dims: ParallelDims, partition: list[int] | None = None) -> list[int]:
    """Bytes of each rank's host image (and device region), in rank order, without building any."""
    return [WeightLayout.of(shard_model(shard_for(cfg, dims, r, partition)), TORCH_DTYPES[cfg.dtype]).nbytes
            for r in range(dims.world_size)]
