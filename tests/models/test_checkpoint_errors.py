"""Checkpoint loading: round trip through save_checkpoint, and bad input named precisely.

Checkpoints here come from ``save_checkpoint`` of the tiny presets with random weights (no
``transformers`` needed), then get damaged: a config field, a tensor, a file, an index.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from computron.memory.layout import WeightLayout
from computron.models import CheckpointError, DecoderLM, get_preset, load_weights, read_config, save_checkpoint
from computron.models.checkpoint import expected_shapes


def _random_views(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in expected_shapes(cfg).items()}


def _empty_views(cfg, dtype=torch.float32) -> dict[str, torch.Tensor]:
    layout = WeightLayout.of(DecoderLM(cfg), dtype)
    return layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))


@pytest.fixture
def ckpt(tmp_path):
    cfg = get_preset("tiny-llama")
    views = _random_views(cfg)
    save_checkpoint(tmp_path / "ck", cfg, views)
    return tmp_path / "ck", cfg, views


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt", "tiny-gpt2"])
def test_save_then_load_round_trips(tmp_path, preset):
    cfg = get_preset(preset)
    views = _random_views(cfg)
    save_checkpoint(tmp_path, cfg, views)
    back = read_config(tmp_path)
    assert back == cfg.with_(name=tmp_path.name)
    loaded = _empty_views(back, torch.float16)  # load converts to the views' dtype
    load_weights(tmp_path, back, loaded)
    for name, t in views.items():
        torch.testing.assert_close(loaded[name], t.half())


def test_partial_views(ckpt):
    path, cfg, views = ckpt
    only = {"layers.1.attn.qkv_weight": torch.empty(views["layers.1.attn.qkv_weight"].shape)}
    load_weights(path, cfg, only)  # one pipeline stage may load just its own parameters
    torch.testing.assert_close(only["layers.1.attn.qkv_weight"], views["layers.1.attn.qkv_weight"])
    with pytest.raises(CheckpointError, match=rf"has shape \[32, {cfg.ffn_size}\], expected \[64, {cfg.ffn_size}\]"):
        load_weights(path, cfg, {"layers.0.mlp.down_weight": torch.empty(32, cfg.ffn_size)})


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, pattern", [
    (dict(model_type="bert"), "model_type='bert'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_parameters.rope_type='llama3'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type='linear'"),
    (dict(hidden_act="gelu_10"), "hidden_act='gelu_10'"),
    (dict(head_dim=32), "head_dim=32"),
    (dict(dtype="float8_e4m3fn"), "float8_e4m3fn"),
    (dict(num_key_value_heads=3), "num_kv_heads"),
])
def test_unsupported_config_names_field(ckpt, changes, pattern):
    path = ckpt[0]
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=pattern):
        read_config(path)


def test_missing_field(ckpt):
    path = ckpt[0]
    cfg = json.loads((path / "config.json").read_text())
    del cfg["intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        read_config(path)


def _resave(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_missing_tensor_is_named(ckpt):
    path, cfg, _ = ckpt
    _resave(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'layers.1.self_attn.k_proj.weight' "
                                              r"\(needed for layers.1.attn.qkv_weight\)"):
        load_weights(path, cfg, _empty_views(cfg))


def test_wrong_shape_is_named(ckpt):
    path, cfg, _ = ckpt
    _resave(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' in .*model.safetensors "
                                              r"has shape \[3, 64\], expected \[172, 64\]"):
        load_weights(path, cfg, _empty_views(cfg))


def test_integer_tensor_is_refused(ckpt):
    path, cfg, _ = ckpt
    _resave(path, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match="model.norm.weight.*int8"):
        load_weights(path, cfg, _empty_views(cfg))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(ckpt, damage):
    path, cfg, _ = ckpt
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(path, cfg, _empty_views(cfg))


def test_index_naming_a_missing_shard(ckpt):
    path, cfg, _ = ckpt
    names = list(load_file(str(path / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_weights(path, cfg, _empty_views(cfg))


def test_no_safetensors_file(ckpt):
    path, cfg, _ = ckpt
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors.*pickled"):
        load_weights(path, cfg, _empty_views(cfg))


def test_bad_views(ckpt):
    path, cfg, _ = ckpt
    with pytest.raises(CheckpointError, match="'layers.0.attn.o_weight' has shape"):
        load_weights(path, cfg, {"layers.0.attn.o_weight": torch.empty(2, 2)})
    with pytest.raises(CheckpointError, match="'layers.7.attn.o_weight' is not a parameter"):
        load_weights(path, cfg, {"layers.7.attn.o_weight": torch.empty(64, 64)})
