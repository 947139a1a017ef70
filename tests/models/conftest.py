"""Shared helpers for the model tests: tiny HF reference checkpoints and our model run on them.

What flows through: a ``transformers`` config → a randomly initialised HF model saved as
safetensors in a tmp dir → our read_config/load_weights → a DecoderLM bound to a flat host buffer.
All on the CPU in float32.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from computron.memory.layout import WeightLayout
from computron.models import DecoderLM, bind_weights, load_weights, read_config
from computron.models.kvcache import KVPool, block_bytes, paged_batch


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter (norms and biases included) random values so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(noise + 1.0 if ("norm" in name or ".ln_" in name) and name.endswith("weight") else noise)


def load_ours(path, dtype: torch.dtype = torch.float32):
    """(cfg, model) for the checkpoint in ``path``, weights in one flat uint8 host buffer."""
    cfg = read_config(path, dtype=dtype)
    model = DecoderLM(cfg)
    layout = WeightLayout.of(model, dtype)
    views = layout.views(torch.empty(layout.nbytes, dtype=torch.uint8))
    load_weights(path, cfg, views)
    bind_weights(model, views)
    return cfg, model


def new_cache(cfg, capacity: int = 64, dtype: torch.dtype = torch.float32, block_tokens: int = 4):
    """One sequence's paged cache: (pool, its block ids), the blocks in a shuffled order."""
    n = -(-capacity // block_tokens)
    cfg = cfg.with_(dtype=str(dtype).removeprefix("torch."))
    pool = KVPool(torch.zeros(n * block_bytes(cfg, block_tokens), dtype=torch.uint8), cfg, block_tokens,
                  block_bytes(cfg, block_tokens))
    ids = list(range(n))
    random.Random(n).shuffle(ids)
    return pool, ids


@torch.no_grad()
def step(model, ids: list[int], past: int, cache) -> torch.Tensor:
    """Logits [len(ids), vocab] for one sequence's new tokens after ``past`` cached ones."""
    pool, blocks = cache
    n = len(ids)
    return model(torch.tensor(ids), torch.arange(past, past + n), paged_batch(pool, [(blocks, past, n)], "cpu"))


@pytest.fixture(scope="session")
def lm():
    """The helpers above as a fixture (conftest modules are not meant to be imported)."""
    return SimpleNamespace(randomize=randomize, load_ours=load_ours, new_cache=new_cache, step=step)
