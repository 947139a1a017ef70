"""ModelConfig: the shape and family switches of one decoder-only Transformer.

One config covers the OPT, GPT-2 and Llama families: norm type, position encoding, activation,
biases, grouped-query attention and tied embeddings are fields, not subclasses. Pure Python
(no torch import), so the scheduler, planner and simulator can size models without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # "opt" | "gpt2" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    max_position: int
    num_kv_heads: int | None = None  # None: same as num_heads (no grouped-query attention)
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    position: str = "learned"  # "learned" | "rope"
    position_offset: int = 0  # OPT's learned positions start at index 2
    rope_theta: float = 10000.0
    activation: str = "relu"  # "relu" | "gelu" | "gelu_new" | "silu"
    gated_mlp: bool = False  # SwiGLU-style gate/up/down
    attn_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    tie_embeddings: bool = True
    pre_norm: bool = True  # False: OPT-350m's post-attention LayerNorm
    embed_proj_dim: int | None = None  # OPT-350m: embeddings of this width projected in/out
    final_norm: bool = True
    head_size: int | None = None  # None: hidden_size // num_heads; set on a tensor-parallel shard's config
    dtype: str = "float16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in ("opt", "gpt2", "llama"):
            raise ValueError(f"unknown model family {self.family!r} (opt, gpt2 or llama)")
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r} ({', '.join(DTYPE_BYTES)})")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """Bytes of key and value cache one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
