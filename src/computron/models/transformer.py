"""One decoder-only Transformer for the OPT, GPT-2 and Llama families.

What flows through: a flat batch of token ids ``[N]`` (all sequences of a step laid end to end,
prefill chunks and single decode tokens alike), their positions ``[N]`` and an ``AttnBatch``
that says where each sequence's tokens are and which blocks of the paged key/value cache hold
its past; attention runs once per layer for the whole batch (``attention.py``). The model is
built on the meta device; its weights are bound later as views into wherever they live (a
host image on the CPU, an arena region on the GPU) by :func:`bind_weights`, so it never owns a
full copy of its own. The runner drives it layer by layer (``embed`` → ``layers[i]`` →
``head``) so it can wait for layer *i*'s swap-in event before computing layer *i*.

Tensor and pipeline parallelism are applied from outside (``parallel/sharding.py``): a shard is
this same model built from a config with fewer heads, a narrower MLP and a vocabulary range,
holding only its stage's layers (``first``/``last`` say whether it embeds and whether it has the
head). The collectives are hooks the sharding plan sets: ``reduce`` on ``Attention``, ``MLP``
(after the row-parallel output projections) and ``DecoderLM`` (after the vocab-parallel
embedding), and ``gather`` on ``DecoderLM`` (the vocab-parallel logits); all None by default, so
the model itself never touches ``torch.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import decode_attention, prefill_attention, write_kv
from .config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class AttnBatch:
    """Where each sequence of a flat token batch sits in a paged key/value cache (``kvcache.py``).

    ``k[i]``/``v[i]``: layer *i*'s cache, ``[num_blocks, block_tokens, kv_heads, head_dim]``;
    ``slots[N]``: where each new token's key and value go (block id * block_tokens + offset);
    ``block_tables[B, max_blocks]``: each sequence's block ids in order; ``seq_lens[B]``: its
    tokens in the cache once this step's are written; ``query_lens[B]``/``cu_query[B+1]``: its
    new tokens and where they start in the flat batch; ``last[B]``: its last new token's row;
    ``decode``: every sequence has exactly one new token.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slots: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    cu_query: torch.Tensor
    last: torch.Tensor
    decode: bool
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of shape [N, head_dim]


@dataclass
class DenseBatch:
    """``seqs`` whole sequences of equal length laid end to end, no cache: causal attention that
    autograd goes through (training). ``rope`` as in :class:`AttnBatch`."""

    seqs: int
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int) -> torch.Tensor:
    """q ``[N, hq, d]``, k/v ``[N, hk, d]`` of ``seqs`` equal sequences → ``[N, hq, d]``."""
    n, hq, d = q.shape
    q, k, v = (x.view(seqs, n // seqs, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != hq)
    return out.transpose(1, 2).reshape(n, hq, d)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = _param(dim)
        self.bias = _param(dim) if (cfg.norm == "layernorm" and cfg.norm_bias) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":  # one fused op (it accumulates in float32 for half inputs)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _activation(name: str):
    if name == "relu":
        return F.relu
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_new":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r} (relu, gelu, gelu_new, silu)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of shape [N, head_dim] for the given positions (rotate-half convention)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    reduce = None  # tensor parallel: sums the row-parallel output over the group (set from outside)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_weight = _param((cfg.num_heads + 2 * cfg.kv_heads) * d, h)
        self.qkv_bias = _param((cfg.num_heads + 2 * cfg.kv_heads) * d) if cfg.attn_bias else None
        self.o_weight = _param(h, cfg.num_heads * d)
        self.o_bias = _param(h) if cfg.attn_bias else None

    def forward(self, x: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        hq, hk = cfg.num_heads, cfg.kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        qk, v = qkv.split([(hq + hk) * d, hk * d], dim=-1)
        qk, v = qk.view(-1, hq + hk, d), v.view(-1, hk, d)
        if batch.rope is not None:  # queries and keys rotated together: half the kernel launches
            cos, sin = batch.rope[0][:, None, :], batch.rope[1][:, None, :]
            qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([hq, hk], dim=1)
        if isinstance(batch, DenseBatch):
            out = F.linear(dense_causal_attention(q, k, v, batch.seqs).reshape(-1, hq * d), self.o_weight, self.o_bias)
            return out if self.reduce is None else self.reduce(out)
        kc, vc = batch.k[self.layer_idx], batch.v[self.layer_idx]
        write_kv(kc, vc, k, v, batch.slots)
        if batch.decode:
            out = decode_attention(q, kc, vc, batch.block_tables, batch.seq_lens)
        else:
            out = prefill_attention(q, kc, vc, batch.block_tables, batch.seq_lens, batch.query_lens, batch.cu_query)
        out = F.linear(out.reshape(-1, hq * d), self.o_weight, self.o_bias)
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    reduce = None  # tensor parallel: sums the row-parallel output over the group (set from outside)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.gated = cfg.gated_mlp
        self.act = _activation(cfg.activation)
        self.up_weight = _param((2 if cfg.gated_mlp else 1) * f, h)  # gated: [gate; up]
        self.up_bias = _param((2 if cfg.gated_mlp else 1) * f) if cfg.mlp_bias else None
        self.down_weight = _param(h, f)
        self.down_bias = _param(h) if cfg.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.up_weight, self.up_bias)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        y = F.linear(y, self.down_weight, self.down_bias)
        return y if self.reduce is None else self.reduce(y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.attn_norm = Norm(cfg, cfg.hidden_size)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = Norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.attn_norm(x), batch)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attn(x, batch))
        return self.mlp_norm(x + self.mlp(x))


class DecoderLM(nn.Module):
    """Embeddings, ``num_layers`` decoder layers and an LM head; weights bound from outside.

    ``first=False`` (a later pipeline stage) leaves out the embeddings, ``last=False`` the final
    norm and head; a last stage of a tied model keeps ``embed_tokens`` as its head's weight.
    ``vocab_start``: the first token id of this shard's vocabulary range (vocab parallel).
    """

    reduce = None  # tensor parallel: sums the vocab-parallel embedding over the group
    gather = None  # tensor parallel: joins the vocab-parallel logits into the full vocabulary
    # [vocab] added to the logits (-inf at ids that are never to be produced), or None: a preset's
    # random weights would otherwise emit ids its tokenizer has no text for
    logit_mask: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, first: bool = True, last: bool = True, vocab_start: int = 0):
        super().__init__()
        self.cfg, self.first, self.last, self.vocab_start = cfg, first, last, vocab_start
        e = cfg.embed_proj_dim or cfg.hidden_size
        self.embed_tokens = _param(cfg.vocab_size, e) if first or (last and cfg.tie_embeddings) else None
        self.embed_positions = (
            _param(cfg.max_position + cfg.position_offset, cfg.hidden_size)
            if first and cfg.position == "learned" else None
        )
        self.project_in = _param(cfg.hidden_size, e) if first and cfg.embed_proj_dim else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = Norm(cfg, cfg.hidden_size) if last and cfg.final_norm else None
        self.project_out = _param(e, cfg.hidden_size) if last and cfg.embed_proj_dim else None
        self.lm_head = None if cfg.tie_embeddings or not last else _param(cfg.vocab_size, e)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            x = F.embedding(ids, self.embed_tokens)
        else:  # vocab parallel: rows of ids outside this shard's range are zero, then summed
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
            x = self.reduce(x.masked_fill(outside[:, None], 0.0))
        if self.project_in is not None:
            x = F.linear(x, self.project_in)
        if self.embed_positions is not None:
            x = x + F.embedding(positions + self.cfg.position_offset, self.embed_positions)
        return x

    def head(self, x: torch.Tensor, align: int = 1, trim: bool = True) -> torch.Tensor:
        """Logits of hidden states ``x``. ``align``: the product runs over the vocabulary's rows padded
        to a multiple of it (zeros, sliced off after): an odd vocabulary such as GPT-2's 50,257 rows
        otherwise gets a far slower matrix kernel on large batches (training: 128). ``trim=False``
        keeps an unsharded head's padded columns (logit 0, for the caller to slice off): a contiguous
        tensor, where the sliced one is a strided view (what a pipeline stage must not emit). A
        vocabulary-sharded head trims each shard before the gather whatever ``trim`` says."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = F.linear(x, self.project_out)
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        pad = -w.shape[0] % align
        logits = F.linear(x, F.pad(w, (0, 0, 0, pad))) if pad else F.linear(x, w)
        if pad and (trim or self.gather is not None or self.logit_mask is not None):
            logits = logits[..., :w.shape[0]]
        if self.gather is not None:
            logits = self.gather(logits)
        return logits if self.logit_mask is None else logits + self.logit_mask

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        """Logits ``[N, vocab]`` for a flat batch (no swap events: for tests and references)."""
        if self.cfg.position == "rope":
            batch.rope = rope_tables(self.cfg, positions, self.embed_tokens.dtype)
        x = self.embed(ids, positions)
        for layer in self.layers:
            x = layer(x, batch)
        return self.head(x)


def parameter_groups(model: DecoderLM) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters in swap order: [embeddings], [layer 0], ..., [layer L-1], [final norm + head]."""
    names = dict(model.named_parameters())
    lead = ("embed_tokens", "embed_positions", "project_in") if model.first else ()
    first = [n for n in names if not n.startswith("layers.") and n.split(".")[0] in lead]
    groups = [[(n, names[n]) for n in first]]
    for i in range(model.cfg.num_layers):
        prefix = f"layers.{i}."
        groups.append([(n, p) for n, p in names.items() if n.startswith(prefix)])
    used = {n for g in groups for n, _ in g}
    groups.append([(n, p) for n, p in names.items() if n not in used])
    return groups


def bind_weights(model: DecoderLM, tensors: dict[str, torch.Tensor]) -> None:
    """Point every parameter of ``model`` at the given tensors (views; nothing is copied)."""
    for name, t in tensors.items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)


def init_std(name: str, cfg: ModelConfig) -> float | None:
    """How a preset without checkpoint initialises a parameter: None = ones (norm weight), 0 = zeros."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias"):
        return 0.0
    if "norm" in name and leaf == "weight":
        return None
    return 0.02 / math.sqrt(2 * cfg.num_layers) if leaf in ("o_weight", "down_weight") else 0.02
