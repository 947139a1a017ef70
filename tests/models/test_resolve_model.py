"""resolve_model: a preset name or a checkpoint directory → (ModelConfig, checkpoint dir or None)."""

from __future__ import annotations

import json

import pytest

from computron.models import CheckpointError, PRESETS, get_preset, read_config, resolve_model, save_checkpoint
from computron.models.checkpoint import expected_shapes


def test_preset_resolves_without_directory():
    cfg, path = resolve_model("tiny-opt")
    assert (cfg, path) == (PRESETS["tiny-opt"], None)
    assert resolve_model("opt-125m", dtype="bfloat16")[0].dtype == "bfloat16"


def test_directory_resolves_to_its_config(tmp_path):
    import torch

    cfg = get_preset("tiny-gpt2")
    save_checkpoint(tmp_path / "my-model", cfg, {n: torch.zeros(s) for n, s in expected_shapes(cfg).items()})
    got, path = resolve_model(str(tmp_path / "my-model"), dtype="float16")
    assert path == str(tmp_path / "my-model")
    assert got == cfg.with_(name="my-model", dtype="float16")


def test_neither_preset_nor_directory_lists_presets(tmp_path):
    with pytest.raises(ValueError, match="tiny-llama"):
        resolve_model("no-such-model")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_hf4_style_config(tmp_path):
    """transformers 4.x keys: torch_dtype, top-level rope_theta, rope_scaling null, a list of EOS ids."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=None, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=[2, 7])))
    cfg = read_config(tmp_path)
    assert (cfg.dtype, cfg.rope_theta, cfg.eos_token_id, cfg.extra["eos_token_ids"]) == ("bfloat16", 5e5, 2, [2, 7])
    assert (cfg.norm_eps, cfg.kv_heads, cfg.tie_embeddings, cfg.attn_bias) == (1e-5, 2, False, False)


def test_mistral_sliding_window_caps_positions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        vocab_size=300, max_position_embeddings=32768, sliding_window=4096, hidden_act="silu")))
    assert read_config(tmp_path).max_position == 4096


def test_package_import_does_not_import_torch(tmp_path):
    """Presets, tokenizers and read_config serve the torch-free scheduler and planner."""
    import subprocess
    import sys

    from computron.models.checkpoint import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(get_preset("tiny-opt"))))
    code = ("import sys, computron.models as m; cfg, _ = m.resolve_model('tiny-llama'); "
            "m.load_tokenizer(None, cfg).encode('x'); m.resolve_model(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; m.DecoderLM; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
