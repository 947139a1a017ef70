"""Models: the decoder, its presets, and checkpoint + tokenizer loading.

``resolve_model(name_or_dir)`` turns what a user names (a preset or a Hugging Face checkpoint
directory) into a ModelConfig and the directory its weights and tokenizer come from. Importing
this package does not import torch (the scheduler, planner and simulator use ModelConfig without
it); the torch-backed names (DecoderLM, AttnBatch, bind_weights) load on first access.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError, load_weights, read_config, save_checkpoint
from .config import ModelConfig
from .presets import ALIASES, PRESETS, canonical_name, get_preset
from .tokenizer import IncrementalDecoder, Tokenizer, decode_stream, load_tokenizer

_TORCH_NAMES = ("AttnBatch", "DecoderLM", "bind_weights")

__all__ = [
    "ALIASES", "AttnBatch", "CheckpointError", "DecoderLM", "IncrementalDecoder", "ModelConfig", "PRESETS", "Tokenizer",
    "bind_weights", "canonical_name", "decode_stream", "get_preset", "load_tokenizer", "load_weights", "read_config",
    "resolve_model", "save_checkpoint",
]


def resolve_model(name_or_dir: str | Path, dtype: str | None = None) -> tuple[ModelConfig, str | None]:
    """(config, checkpoint directory) for a checkpoint directory, or (preset, None) for a preset name.

    A directory holding ``config.json`` wins over a preset of the same name (or alias, see
    ``presets.ALIASES``); ``dtype`` overrides the stored or preset dtype.
    """
    if canonical_name(str(name_or_dir)) in PRESETS:
        cfg = PRESETS[canonical_name(str(name_or_dir))]
        if not (Path(name_or_dir) / "config.json").is_file():
            return (cfg.with_(dtype=str(dtype).removeprefix("torch.")) if dtype else cfg), None
    shown = str(name_or_dir) if len(str(name_or_dir)) <= 80 else str(name_or_dir)[:77] + "..."
    path = Path(name_or_dir).expanduser()
    try:
        if (path / "config.json").is_file():
            return read_config(path, dtype), str(path)
        is_dir = path.is_dir()
    except OSError as e:  # e.g. a name too long for the file system
        raise ValueError(f"unknown model {shown!r}: not a preset, and not a readable path ({e.strerror})") from None
    if is_dir:
        raise CheckpointError(f"checkpoint {path} has no config.json")
    raise ValueError(f"unknown model {shown!r}: neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from . import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
