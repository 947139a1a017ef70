"""The model being trained: shape, batch and family switches, with presets and YAML loading.

What flows through: ``--model`` (a preset name or a YAML file, optionally with a ``preset:`` base
and overrides) becomes a :class:`TransformerShape`. Parameter counts per tensor-parallel rank are
derived here (used by the memory model and the gradient all-reduce); FLOPs and times live in costs.py.

This is a training-side description (sequence length, global batch) of the same decoder shapes
``computron.models`` serves; it imports only the pure-Python preset table from there. A model both
know goes by the name ``computron.models.presets`` gives it (``llama-2-7b``, ``gpt2-xl``), and
both resolve names through its one alias table (``llama2-7b``, ``gpt2-1.5b`` still work).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, fields, replace

from ..models.presets import ALIASES as ENGINE_ALIASES, canonical_name
from .errors import PlannerError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2}
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")  # computron.models' names (gelu_new: tanh approximation)


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only Transformer and its training batch.

    ``family`` "gpt": LayerNorm, GeLU MLP, biases, learned positions, dropout, tied embeddings.
    ``family`` "llama": RMSNorm, gated SiLU MLP (3 matrices), no biases, RoPE, untied, no dropout.
    ``flash_attention``: fused attention (no s*s score tensor in memory, causal blocks skipped).
    ``activation``: the MLP's (None: the family's, gelu_new or silu); OPT is the gpt family with
    ``relu``, which keeps less for backward (costs.activation_bytes) and is what ``plan profile``
    must build to measure OPT's layer. ``pre_norm`` False: the norms after the residual adds
    (OPT-350m).
    """

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    global_batch: int
    kv_heads: int | None = None
    dtype: str = "float16"
    tie_embeddings: bool | None = None  # None: family default
    flash_attention: bool | None = None  # None: family default
    dropout: bool | None = None  # None: family default
    activation: str | None = None  # None: family default
    pre_norm: bool = True

    def __post_init__(self) -> None:
        if self.family not in ("gpt", "llama"):
            raise PlannerError(f"model {self.name}: unknown family {self.family!r} (gpt or llama)")
        for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "global_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlannerError(f"model {self.name}: {f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise PlannerError(f"model {self.name}: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.kv_heads is not None and (not isinstance(self.kv_heads, int) or self.kv_heads < 1):
            raise PlannerError(f"model {self.name}: kv_heads must be a positive integer, got {self.kv_heads!r}")
        if self.heads % self.kv:
            raise PlannerError(f"model {self.name}: heads {self.heads} is not a multiple of kv_heads {self.kv}")
        if self.dtype not in DTYPE_BYTES:
            raise PlannerError(f"model {self.name}: dtype {self.dtype!r} not supported (float16 or bfloat16)")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise PlannerError(f"model {self.name}: unknown activation {self.activation!r} ({', '.join(ACTIVATIONS)})")
        llama = self.family == "llama"
        if self.activation is None:
            object.__setattr__(self, "activation", "silu" if llama else "gelu_new")
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", not llama)
        if self.flash_attention is None:
            object.__setattr__(self, "flash_attention", llama)
        if self.dropout is None:
            object.__setattr__(self, "dropout", not llama)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.family == "llama"

    @property
    def biases(self) -> bool:
        return self.family == "gpt"

    @property
    def bytes_per_elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def context_shard(self, cp: int) -> TransformerShape:
        """What one of ``cp`` context-parallel ranks computes on: s/cp tokens of every sequence
        (per-token costs and activations; parameters are counted on the whole model)."""
        return self if cp == 1 else _context_shard(self, cp)

    def kv_heads_per_rank(self, tp: int) -> int:
        """K/V heads each TP rank holds: kv/tp, or 1 (replicated) when tp exceeds kv."""
        return max(self.kv // tp, 1)

    # ---- parameter counts (elements) ----
    def layer_params(self, tp: int = 1) -> float:
        """Parameters of one Transformer layer held by one TP rank.

        Column-parallel matrices (QKV, MLP up/gate) and their biases, and row-parallel matrices
        (attention out, MLP down), are split over ``tp``; norms and row-parallel biases are replicated.
        """
        h, d = self.hidden, self.head_dim
        q_cols = self.heads // tp * d
        kv_cols = self.kv_heads_per_rank(tp) * d
        f = self.ffn / tp
        up = (2 if self.gated else 1) * f
        p = h * (q_cols + 2 * kv_cols) + q_cols * h + h * up + f * h
        norms = 2 * h * (2 if self.biases else 1)
        if self.biases:
            p += (q_cols + 2 * kv_cols) + h + up + h
        return p + norms

    def embedding_params(self, tp: int = 1) -> float:
        """Input embedding on the first stage: vocab-parallel word table (+ learned positions)."""
        pos = self.seq_len * self.hidden if self.family == "gpt" else 0
        return self.vocab * self.hidden / tp + pos

    def head_params(self, tp: int = 1, pp: int = 1) -> float:
        """Last stage: final norm plus the output projection (a second copy when tied and pp>1)."""
        norm = self.hidden * (2 if self.biases else 1)
        if self.tie_embeddings and pp == 1:
            return norm  # same matrix as the input embedding, already counted
        return norm + self.vocab * self.hidden / tp

    def total_params(self) -> float:
        return self.layers * self.layer_params(1) + self.embedding_params(1) + self.head_params(1, 1)

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=256)
def _context_shard(m: TransformerShape, cp: int) -> TransformerShape:
    return replace(m, seq_len=m.seq_len // cp)


def _gpt(name, layers, hidden, heads, seq, batch, vocab=50257, ffn=None):
    return TransformerShape(name, "gpt", layers, hidden, heads, ffn or 4 * hidden, vocab, seq, batch,
                            dtype="float16")


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq, batch):
    return TransformerShape(name, "llama", layers, hidden, heads, ffn, vocab, seq, batch, kv_heads=kv,
                            dtype="bfloat16")


PRESETS: dict[str, TransformerShape] = {m.name: m for m in [
    _gpt("gpt2", 12, 768, 12, 1024, 512),
    _gpt("gpt2-medium", 24, 1024, 16, 1024, 512),
    _gpt("gpt2-large", 36, 1280, 20, 1024, 512),
    _gpt("gpt2-xl", 48, 1600, 25, 1024, 512),
    # GPT-3 shapes (Brown et al. 2020, Table 2.1); global batch from the paper's token batch / 2048
    _gpt("gpt3-1.3b", 24, 2048, 16, 2048, 512),
    _gpt("gpt3-2.7b", 32, 2560, 32, 2048, 512),
    _gpt("gpt3-6.7b", 32, 4096, 32, 2048, 1024),
    _gpt("gpt3-13b", 40, 5120, 40, 2048, 1024),
    _gpt("gpt3-175b", 96, 12288, 96, 2048, 1536),
    # Llama 2 (Touvron et al. 2023): 4M-token batches of 4096; Llama 3: 8192-token context
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1024),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 1024),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1024),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 512),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 512),
]}

# Other spellings (the planner's earlier names among them) resolve through the engine's one table.
ALIASES: dict[str, str] = {old: new for old, new in ENGINE_ALIASES.items() if new in PRESETS}

_FIELDS = {f.name for f in fields(TransformerShape)}


def model_from_dict(data: dict, default_name: str = "custom") -> TransformerShape:
    """A model from parsed YAML: either all fields, or ``preset: NAME`` plus overrides."""
    if not isinstance(data, dict):
        raise PlannerError("model YAML must be a mapping of field: value")
    data = dict(data)
    base = data.pop("preset", None)
    unknown = set(data) - _FIELDS
    if unknown:
        raise PlannerError(f"model YAML: unknown fields {sorted(unknown)} (allowed: preset, {', '.join(sorted(_FIELDS))})")
    if base is not None:
        return replace(preset(str(base)), **data)
    missing = {"family", "layers", "hidden", "heads", "ffn", "vocab", "seq_len", "global_batch"} - set(data)
    if missing:
        raise PlannerError(f"model YAML without 'preset' needs {sorted(missing)}")
    data.setdefault("name", default_name)
    return TransformerShape(**data)


def preset(name: str) -> TransformerShape:
    """A preset by its name or an alias of it (case-insensitive)."""
    key = canonical_name(name)
    if key not in PRESETS:
        raise PlannerError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or a YAML file)")
    return PRESETS[key]


def load_model(arg: str, **overrides) -> TransformerShape:
    """``--model``: a preset name or a YAML file; ``overrides`` (seq_len=..., global_batch=...) win."""
    if arg.endswith((".yaml", ".yml", ".json")) or os.path.isfile(arg):
        import yaml

        if not os.path.isfile(arg):
            raise PlannerError(f"model file {arg!r} does not exist")
        with open(arg) as f:
            spec = model_from_dict(yaml.safe_load(f), os.path.splitext(os.path.basename(arg))[0])
    else:
        spec = preset(arg)
    over = {k: v for k, v in overrides.items() if v is not None}
    return replace(spec, **over) if over else spec
