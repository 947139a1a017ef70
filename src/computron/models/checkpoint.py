"""Hugging Face checkpoints: config.json → ModelConfig, safetensors tensors → our weight views.

What flows through: a checkpoint directory (``config.json`` plus one ``*.safetensors`` file, or
several named by ``model.safetensors.index.json``) is read on the CPU, tensor by tensor through
``safe_open`` (memory-mapped; never pickle, never the whole checkpoint at once). Each tensor is
renamed to our parameter names (q/k/v fused into ``qkv_weight``, gate/up into ``up_weight``,
GPT-2's transposed Conv1D weights turned back), cast to the view's dtype and copied into the
caller's views, typically ``WeightLayout.views`` of a pinned host image. Every problem raises a
:class:`CheckpointError` naming the directory, the file and the tensor concerned. torch and
safetensors are imported by the functions that touch tensors, so ``read_config`` stays pure Python
(the planner and simulator size models from a checkpoint without torch).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import DTYPE_BYTES, ModelConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_PREFIXES = ("model.", "decoder.", "transformer.")  # HF wrappers around the decoder stack
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new",
                "silu": "silu", "swish": "silu"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a model of the supported families."""


# ----------------------------------------------------------------------------- config.json


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent} has no {path.name}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})")
    return name


def _activation(hf: dict, key: str, where: Path) -> str:
    act = hf.get(key)
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{where}: unsupported {key}={act!r} (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[act]


def _rope_theta(hf: dict, where: Path) -> float:
    """Plain RoPE only; transformers 5 nests it under ``rope_parameters``, 4.x uses ``rope_scaling``."""
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"{where}: unsupported {key}.rope_type={kind!r} (only plain RoPE, 'default')")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{where}: unsupported {key}.partial_rotary_factor="
                                  f"{params['partial_rotary_factor']!r}")
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _family_fields(hf: dict, where: Path) -> dict:
    """The ModelConfig fields of one HF config dict, by ``model_type``."""
    kind = hf.get("model_type")
    if kind == "opt":
        if not hf.get("layer_norm_elementwise_affine", True):
            raise CheckpointError(f"{where}: unsupported layer_norm_elementwise_affine=False")
        h, proj = hf["hidden_size"], hf.get("word_embed_proj_dim") or hf["hidden_size"]
        pre = hf.get("do_layer_norm_before", True)
        bias = hf.get("enable_bias", True)
        return dict(family="opt", hidden_size=h, num_layers=hf["num_hidden_layers"],
                    num_heads=hf["num_attention_heads"], ffn_size=hf["ffn_dim"],
                    max_position=hf["max_position_embeddings"], position_offset=2,
                    activation=_activation(hf, "activation_function", where), attn_bias=bias, mlp_bias=bias,
                    pre_norm=pre, final_norm=pre and not hf.get("_remove_final_layer_norm", False),
                    embed_proj_dim=proj if proj != h else None, tie_embeddings=hf.get("tie_word_embeddings", True))
    if kind == "gpt2":
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
            if hf.get(key, ok) != ok:
                raise CheckpointError(f"{where}: unsupported {key}={hf[key]!r}")
        h = hf["n_embd"]
        return dict(family="gpt2", hidden_size=h, num_layers=hf["n_layer"], num_heads=hf["n_head"],
                    ffn_size=hf.get("n_inner") or 4 * h, max_position=hf["n_positions"],
                    norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                    activation=_activation(hf, "activation_function", where),
                    tie_embeddings=hf.get("tie_word_embeddings", True))
    if kind in ("llama", "mistral"):
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, h // heads):
            raise CheckpointError(f"{where}: unsupported head_dim={hf['head_dim']} (need hidden_size/heads)")
        max_pos = hf.get("max_position_embeddings", 2048)
        if hf.get("sliding_window"):  # exact as long as no sequence outgrows the window
            max_pos = min(max_pos, hf["sliding_window"])
        return dict(family="llama", hidden_size=h, num_layers=hf["num_hidden_layers"], num_heads=heads,
                    num_kv_heads=hf.get("num_key_value_heads") or heads, ffn_size=hf["intermediate_size"],
                    max_position=max_pos, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), position="rope",
                    rope_theta=_rope_theta(hf, where), activation=_activation(hf, "hidden_act", where),
                    gated_mlp=True, attn_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
                    norm_bias=False, tie_embeddings=hf.get("tie_word_embeddings", False))
    raise CheckpointError(f"{where}: unsupported model_type={kind!r} (opt, gpt2, llama, mistral)")


def read_config(path: str | Path, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """ModelConfig of the checkpoint in ``path`` (its ``config.json``); ``dtype`` overrides the stored one.

    The stored dtype is ``dtype`` (transformers 5) or ``torch_dtype`` (4.x); float16 when absent.
    """
    path = Path(path).expanduser()
    where = path / "config.json"
    hf = _load_json(where)
    try:
        fields = _family_fields(hf, where)
    except KeyError as e:
        raise CheckpointError(f"{where} lacks field {e.args[0]!r}") from None
    stored = hf.get("dtype") or hf.get("torch_dtype")
    eos = hf.get("eos_token_id")
    eos_all = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    try:
        return ModelConfig(
            name=path.resolve().name, vocab_size=hf["vocab_size"],
            dtype=_dtype_name(dtype if dtype is not None else stored if stored not in (None, "auto") else "float16"),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos_all[0] if eos_all else None,
            extra={"model_type": hf["model_type"], "eos_token_ids": eos_all}, **fields)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------- name mapping


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor filling rows ``[row, row + rows)`` of one of our parameters."""

    source: str  # HF tensor name without the model./decoder./transformer. prefixes
    row: int
    rows: int
    transpose: bool = False  # GPT-2's Conv1D stores weights as [in, out]


def _local_sources(cfg: ModelConfig, local: str) -> list[tuple[str, int, bool]]:
    """(HF name, row count, transposed) of each piece of one of our names, layer prefix removed."""
    d, f = cfg.head_dim, cfg.ffn_size
    q, kv = cfg.num_heads * d, cfg.kv_heads * d
    module, _, leaf = local.rpartition(".")
    if cfg.family == "gpt2":
        names = {"embed_tokens": "wte.weight", "embed_positions": "wpe.weight", "final_norm": "ln_f",
                 "attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.qkv": "attn.c_attn", "attn.o": "attn.c_proj",
                 "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
    elif cfg.family == "opt":
        names = {"final_norm": "final_layer_norm", "attn_norm": "self_attn_layer_norm",
                 "mlp_norm": "final_layer_norm", "attn.o": "self_attn.out_proj", "mlp.up": "fc1", "mlp.down": "fc2"}
    else:
        names = {"final_norm": "norm", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                 "attn.o": "self_attn.o_proj", "mlp.down": "mlp.down_proj"}
    conv = cfg.family == "gpt2"
    if module in ("attn", "mlp"):  # attn.qkv_weight → key "attn.qkv", leaf "weight"
        key, leaf = f"{module}.{leaf.split('_')[0]}", leaf.split("_")[1]
        if key == "attn.qkv" and not conv:
            return [(f"self_attn.{p}_proj.{leaf}", n, False) for p, n in (("q", q), ("k", kv), ("v", kv))]
        if key == "mlp.up" and cfg.gated_mlp:
            return [(f"mlp.{p}_proj.{leaf}", f, False) for p in ("gate", "up")]
        return [(f"{names.get(key, key)}.{leaf}", -1, conv and leaf == "weight")]
    if module:  # a norm: attn_norm.weight
        return [(f"{names[module]}.{leaf}", -1, False)]
    return [(names.get(leaf, f"{leaf}.weight"), -1, False)]  # embed_tokens, project_in, lm_head, ...


def plan(cfg: ModelConfig, name: str, rows: int) -> list[Piece]:
    """The checkpoint pieces of our parameter ``name`` (``rows`` long in dim 0), in row order."""
    prefix = ""
    if name.startswith("layers."):
        i, name = name.split(".", 2)[1:]
        prefix = f"h.{i}." if cfg.family == "gpt2" else f"layers.{i}."
    pieces, row = [], 0
    for source, n, transpose in _local_sources(cfg, name):
        n = rows if n < 0 else n
        pieces.append(Piece(prefix + source, row, n, transpose))
        row += n
    return pieces


# ----------------------------------------------------------------------------- safetensors files


def _strip(name: str) -> str:
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def tensor_files(path: str | Path) -> dict[str, tuple[Path, str]]:
    """Checkpoint tensor index: stripped name → (file, name inside the file). Reads headers only."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.exists():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{index} names shard {shard!r}, which is missing from {path}")
        return {_strip(n): (path / f, n) for n, f in weight_map.items()}
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        bins = " (pickled *.bin files are not read: convert them to safetensors)" if any(path.glob("*.bin")) else ""
        raise CheckpointError(f"checkpoint {path} has no *.safetensors file{bins}")
    found: dict[str, tuple[Path, str]] = {}
    for file in files:
        with _open(file) as f:
            for n in f.keys():
                found.setdefault(_strip(n), (file, n))
    return found


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for a bad header or a short file
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


class _Reader:
    """Open safetensors files (memory-mapped) and read one tensor at a time."""

    def __init__(self, stack: ExitStack):
        self.stack, self.handles = stack, {}

    def get(self, file: Path, name: str) -> torch.Tensor:
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(_open(file))
        try:
            t = self.handles[file].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} in {file} has dtype {t.dtype}; only float weights load")
        return t


# ----------------------------------------------------------------------------- loading and saving


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and full shapes for ``cfg`` (built on the meta device: no memory)."""
    from .transformer import DecoderLM

    return {n: tuple(p.shape) for n, p in DecoderLM(cfg).named_parameters()}


def load_weights(path: str | Path, cfg: ModelConfig, views: dict[str, torch.Tensor]) -> None:
    """Copy the checkpoint in ``path`` into ``views`` (our name → tensor, each written exactly once).

    ``views`` may hold a subset of the model's parameters (one pipeline stage), each of full shape.
    """
    path = Path(path).expanduser()
    shapes, tensors = expected_shapes(cfg), tensor_files(path)
    written: set[str] = set()
    with ExitStack() as stack:
        reader = _Reader(stack)
        for name, view in views.items():
            if name not in shapes:
                raise CheckpointError(f"view {name!r} is not a parameter of model {cfg.name}")
            full = shapes[name]
            if tuple(view.shape) != full:
                raise CheckpointError(f"view {name!r} has shape {list(view.shape)}, expected {list(full)}")
            for piece in plan(cfg, name, full[0]):
                if piece.source not in tensors:
                    raise CheckpointError(f"checkpoint {path} lacks tensor {piece.source!r} (needed for {name})")
                file, key = tensors[piece.source]
                t = reader.get(file, key)
                t = t.t() if piece.transpose else t
                dest = view[piece.row : piece.row + piece.rows]
                if t.shape != dest.shape:
                    raise CheckpointError(f"tensor {key!r} in {file} has shape {list(t.shape)}, expected "
                                          f"{list(dest.shape)} (for {name})")
                dest.copy_(t)
            written.add(name)
    if written != set(views):  # the loop writes each view once; guard the invariant anyway
        raise CheckpointError(f"views left unwritten: {sorted(set(views) - written)}")
    log.info("loaded %d tensors of %s from %s", len(written), cfg.name, path)


def hf_config(cfg: ModelConfig) -> dict:
    """A config.json dict that :func:`read_config` maps back to ``cfg`` (name aside)."""
    common = dict(vocab_size=cfg.vocab_size, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                  tie_word_embeddings=cfg.tie_embeddings, dtype=cfg.dtype)
    act = {v: k for k, v in _ACTIVATIONS.items() if k != "swish" and k != "gelu_pytorch_tanh"}[cfg.activation]
    if cfg.family == "gpt2":
        return dict(model_type="gpt2", n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                    n_inner=cfg.ffn_size, n_positions=cfg.max_position, layer_norm_epsilon=cfg.norm_eps,
                    activation_function=act, **common)
    if cfg.family == "opt":
        return dict(model_type="opt", hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=cfg.num_heads, ffn_dim=cfg.ffn_size, max_position_embeddings=cfg.max_position,
                    activation_function=act, do_layer_norm_before=cfg.pre_norm, enable_bias=cfg.attn_bias,
                    word_embed_proj_dim=cfg.embed_proj_dim or cfg.hidden_size,
                    _remove_final_layer_norm=cfg.pre_norm and not cfg.final_norm, **common)
    return dict(model_type="llama", hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.ffn_size,
                max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps, hidden_act=act,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias, **common)


def save_checkpoint(path: str | Path, cfg: ModelConfig, views: dict[str, torch.Tensor]) -> Path:
    """Write ``views`` (all parameters of ``cfg``) as an HF-layout checkpoint: config.json + model.safetensors.

    For tests and for giving a preset's random weights a portable form; the inverse of load_weights.
    Tokenizer files, if wanted, are the caller's to add.
    """
    from safetensors.torch import save_file

    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    prefix = {"gpt2": "transformer.", "opt": "model.decoder.", "llama": "model."}[cfg.family]
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name not in views:
            raise CheckpointError(f"save_checkpoint needs every parameter; {name!r} is missing")
        for piece in plan(cfg, name, shape[0]):
            t = views[name][piece.row : piece.row + piece.rows]
            key = piece.source if piece.source == "lm_head.weight" else prefix + piece.source
            out[key] = (t.t() if piece.transpose else t).contiguous().clone()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    return path
