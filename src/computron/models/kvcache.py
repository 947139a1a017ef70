"""Paged key/value cache: per-layer views of a pool of blocks, and the batch description a step needs.

A block holds ``block_tokens`` tokens of every layer, laid out ``[num_layers, 2, block_tokens,
kv_heads, head_dim]``; it is one region of some flat byte buffer (on the serving device: the
arena). Block ids count ``unit`` bytes from the buffer's start: a block with id *b* starts at
byte ``b * unit``. With ``unit`` equal to the block's size the ids are the usual 0, 1, 2, …; with
``unit`` the arena's alignment (512 bytes) a block can sit at any aligned offset, so blocks are
ordinary arena regions that compaction may move (their ids change with their offsets).

``KVPool`` gives each layer's cache as strided views ``[num_ids, block_tokens, kv_heads,
head_dim]`` over the buffer (nothing is copied); ``paged_batch`` turns each sequence's block ids,
cached length and new-token count into the ``AttnBatch`` the model reads.
"""

from __future__ import annotations

import torch

from ..memory.units import kv_region_bytes
from .config import ModelConfig
from .transformer import TORCH_DTYPES, AttnBatch


def block_bytes(cfg: ModelConfig, block_tokens: int) -> int:
    """Bytes of one block (every layer's keys and values of ``block_tokens`` tokens), aligned."""
    return kv_region_bytes(block_tokens, cfg.kv_bytes_per_token())


class KVPool:
    def __init__(self, buffer: torch.Tensor, cfg: ModelConfig, block_tokens: int, unit: int):
        dtype = TORCH_DTYPES[cfg.dtype]
        es = dtype.itemsize
        if buffer.dtype != torch.uint8 or unit % es or buffer.numel() % es:
            raise ValueError(f"a KV pool needs a uint8 buffer and a unit that are multiples of {es} bytes")
        self.cfg, self.block_tokens, self.unit = cfg, block_tokens, unit
        self.block_bytes = block_bytes(cfg, block_tokens)
        if buffer.numel() < self.block_bytes:
            self.k = self.v = []
            return
        flat = buffer.view(dtype)
        num_ids = (buffer.numel() - self.block_bytes) // unit + 1  # every id whose block lies inside
        hk, d, bt = cfg.kv_heads, cfg.head_dim, block_tokens
        size, stride = (num_ids, bt, hk, d), (unit // es, hk * d, d, 1)
        per_layer = 2 * bt * hk * d
        self.k = [flat.as_strided(size, stride, flat.storage_offset() + i * per_layer) for i in range(cfg.num_layers)]
        self.v = [flat.as_strided(size, stride, flat.storage_offset() + i * per_layer + bt * hk * d)
                  for i in range(cfg.num_layers)]


def paged_batch(pool: KVPool, seqs: list[tuple[list[int], int, int]], device: torch.device) -> AttnBatch:
    """The step's batch: ``seqs[s] = (block ids, tokens already cached, new tokens)``, laid end to end."""
    bt = pool.block_tokens
    width = max(len(ids) for ids, _, _ in seqs)
    tables, slots, seq_lens, query_lens, cu = [], [], [], [], [0]
    for ids, past, n in seqs:
        if len(ids) * bt < past + n:
            raise ValueError(f"{len(ids)} blocks of {bt} tokens cannot hold {past + n} tokens")
        tables.append(ids + [0] * (width - len(ids)))
        slots.extend(ids[p // bt] * bt + p % bt for p in range(past, past + n))
        seq_lens.append(past + n)
        query_lens.append(n)
        cu.append(cu[-1] + n)
    meta = torch.tensor([seq_lens, query_lens, cu[1:]], dtype=torch.int64).to(device, non_blocking=True)
    return AttnBatch(
        k=pool.k, v=pool.v,
        slots=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        block_tables=torch.tensor(tables, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=meta[0], query_lens=meta[1],
        cu_query=torch.cat([meta.new_zeros(1), meta[2]]), last=meta[2] - 1,
        decode=all(n == 1 for _, _, n in seqs))
