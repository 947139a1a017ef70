"""Named model presets: tiny ones for the CPU and tests, and the shapes of real OPT/GPT-2/Llama models.

A preset without a checkpoint gets random weights from a fixed seed (see ``memory.host``) and the
small byte-level BPE of ``preset_tokenizer``. Names follow the Hugging Face model ids (``gpt2-xl``,
``llama-2-7b``); :data:`ALIASES` is the one table of other spellings, shared with the planner
(``computron plan``), so every command accepts the same names. Pure Python; no torch import.
"""

from __future__ import annotations

from .config import ModelConfig

_OPT = dict(family="opt", vocab_size=50272, max_position=2048, position_offset=2, activation="relu",
            bos_token_id=2, eos_token_id=2)
_LLAMA = dict(family="llama", norm="rmsnorm", position="rope", activation="silu", gated_mlp=True,
              attn_bias=False, mlp_bias=False, norm_bias=False, tie_embeddings=False, bos_token_id=1,
              eos_token_id=2)


def _opt(name, layers, hidden, heads, **kw):
    return ModelConfig(name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       ffn_size=4 * hidden, **{**_OPT, **kw})


def _llama(name, layers, hidden, heads, ffn, **kw):
    return ModelConfig(name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_size=ffn,
                       **{**_LLAMA, "vocab_size": 32000, "max_position": 4096, **kw})


def _gpt2(name, layers, hidden, heads):
    return ModelConfig(name=name, family="gpt2", vocab_size=50257, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, ffn_size=4 * hidden, max_position=1024, activation="gelu_new",
                       bos_token_id=50256, eos_token_id=50256)


_TINY = dict(vocab_size=512, max_position=512, dtype="float32", bos_token_id=256, eos_token_id=257)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        _opt("tiny-opt", 2, 64, 4, **_TINY),
        _llama("tiny-llama", 2, 64, 4, 172, num_kv_heads=2, **_TINY),
        ModelConfig(name="tiny-gpt2", family="gpt2", hidden_size=64, num_layers=2, num_heads=4, ffn_size=256,
                    activation="gelu_new", **_TINY),
        _opt("opt-125m", 12, 768, 12),
        _opt("opt-350m", 24, 1024, 16, embed_proj_dim=512, pre_norm=False, final_norm=False),
        _opt("opt-1.3b", 24, 2048, 32),
        _opt("opt-2.7b", 32, 2560, 32),
        _opt("opt-6.7b", 32, 4096, 32),
        _opt("opt-13b", 40, 5120, 40),
        _opt("opt-30b", 48, 7168, 56),
        _opt("opt-66b", 64, 9216, 72),
        _gpt2("gpt2", 12, 768, 12),
        _gpt2("gpt2-medium", 24, 1024, 16),
        _gpt2("gpt2-large", 36, 1280, 20),
        _gpt2("gpt2-xl", 48, 1600, 25),
        _llama("llama-2-7b", 32, 4096, 32, 11008),
        _llama("llama-2-13b", 40, 5120, 40, 13824),
        _llama("llama-2-70b", 80, 8192, 64, 28672, num_kv_heads=8),
        _llama("llama-3-8b", 32, 4096, 32, 14336, num_kv_heads=8, vocab_size=128256, max_position=8192,
               rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
        _llama("llama-3-70b", 80, 8192, 64, 28672, num_kv_heads=8, vocab_size=128256, max_position=8192,
               rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    ]
}

# Other spellings of the presets' names (the planner's parameter-count names among them); lower case.
ALIASES: dict[str, str] = {
    "gpt2-small": "gpt2", "gpt2-124m": "gpt2", "gpt2-345m": "gpt2-medium", "gpt2-774m": "gpt2-large",
    "gpt2-1.5b": "gpt2-xl", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b", "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b",
}


def canonical_name(name: str) -> str:
    """The preset name ``name`` stands for (aliases resolved, case ignored); unknown names come back lower-cased."""
    key = name.strip().lower()
    return ALIASES.get(key, key)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[canonical_name(name)]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known presets: {', '.join(PRESETS)} "
                       "(or pass a checkpoint directory)") from None
