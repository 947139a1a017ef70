"""Weight bytes of a model from its config alone (no torch): the simulator's view of a host image.

Mirrors ``DecoderLM`` and ``memory.layout.WeightLayout``: parameters are laid out group by group
(embeddings, layer 0 … layer L−1, final norm + head), each parameter at a 512-byte aligned
offset, so a group's bytes are the sum of its parameters' aligned sizes and the image's bytes are
the sum of the groups. ``tests/sim`` checks this against ``layout_for(cfg)`` for every preset.
"""

from __future__ import annotations

from ..memory.units import ALIGN, align_up
from ..models.config import ModelConfig


def _norm_params(cfg: ModelConfig, dim: int) -> list[int]:
    return [dim, dim] if (cfg.norm == "layernorm" and cfg.norm_bias) else [dim]


def group_params(cfg: ModelConfig) -> list[list[int]]:
    """Element counts of every parameter, by swap group: [embeddings], [layer 0], …, [head]."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    e = cfg.embed_proj_dim or h
    lead = [cfg.vocab_size * e]
    if cfg.position == "learned":
        lead.append((cfg.max_position + cfg.position_offset) * h)
    if cfg.embed_proj_dim:
        lead.append(h * e)
    qkv = (cfg.num_heads + 2 * cfg.kv_heads) * d
    up = (2 if cfg.gated_mlp else 1) * f
    layer = _norm_params(cfg, h) + [qkv * h] + ([qkv] if cfg.attn_bias else []) + [h * cfg.num_heads * d] + \
        ([h] if cfg.attn_bias else []) + _norm_params(cfg, h) + [up * h] + ([up] if cfg.mlp_bias else []) + \
        [h * f] + ([h] if cfg.mlp_bias else [])
    tail = _norm_params(cfg, h) if cfg.final_norm else []
    if cfg.embed_proj_dim:
        tail.append(e * h)
    if not cfg.tie_embeddings:
        tail.append(cfg.vocab_size * e)
    return [lead] + [list(layer) for _ in range(cfg.num_layers)] + [tail]


def group_bytes(cfg: ModelConfig, align: int = ALIGN) -> list[int]:
    """Bytes of each swap group of the model's image (every parameter aligned to ``align``)."""
    b = cfg.dtype_bytes
    return [sum(align_up(n * b, align) for n in g) for g in group_params(cfg)]


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the model's whole image: what ``layout_for(cfg).nbytes`` holds."""
    return sum(group_bytes(cfg))


def num_params(cfg: ModelConfig) -> int:
    return sum(sum(g) for g in group_params(cfg))
