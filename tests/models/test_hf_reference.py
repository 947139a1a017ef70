"""Our DecoderLM on checkpoints written by ``transformers`` matches ``transformers`` itself.

Each family gets a tiny random model, saved with ``save_pretrained`` as safetensors, loaded back
through read_config + load_weights, and compared on full-sequence logits, on cached incremental
decoding (prefix prefill, token-by-token decode, a second chunk with past > 0) and on greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
CONFIGS = {
    "opt": lambda: transformers.OPTConfig(ffn_dim=128, bos_token_id=2, eos_token_id=2, pad_token_id=1, **SMALL),
    "opt-postnorm-proj": lambda: transformers.OPTConfig(ffn_dim=128, do_layer_norm_before=False,
                                                        word_embed_proj_dim=32, pad_token_id=1, **SMALL),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=0),
    "llama-gqa": lambda: transformers.LlamaConfig(intermediate_size=96, num_key_value_heads=2,
                                                  tie_word_embeddings=False, rope_theta=500000.0, **SMALL),
    "llama-bias-tied": lambda: transformers.LlamaConfig(intermediate_size=96, attention_bias=True, mlp_bias=True,
                                                        tie_word_embeddings=True, **SMALL),
    "mistral": lambda: transformers.MistralConfig(intermediate_size=96, num_key_value_heads=1, sliding_window=None,
                                                  **SMALL),
}
IDS = [5, 17, 42, 3, 88, 61, 7, 7, 30, 2, 71, 19, 44, 90, 12, 56]


def _save(kind: str, path, randomize, **save_kw):
    """A random HF model of ``kind`` in eval mode, saved as safetensors under ``path``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager")
    model = model.float().eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True, **save_kw)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, lm):
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(request.param, path, lm.randomize)
    cfg, ours = lm.load_ours(path)
    return ref, cfg, ours


@torch.no_grad()
def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0]


def test_prefill_logits_match(pair, lm):
    ref, cfg, ours = pair
    got = lm.step(ours, IDS, 0, lm.new_cache(cfg))
    torch.testing.assert_close(got, _ref_logits(ref, IDS), atol=1e-4, rtol=1e-4)


def test_cached_decode_matches_full_sequence(pair, lm):
    ref, cfg, ours = pair
    want, cache = _ref_logits(ref, IDS), lm.new_cache(cfg)
    got = [lm.step(ours, IDS[:6], 0, cache)]  # prefix prefill
    got += [lm.step(ours, [t], p, cache) for p, t in enumerate(IDS[6:10], start=6)]  # one token at a time
    got.append(lm.step(ours, IDS[10:], 10, cache))  # a second chunk with past > 0
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_two_sequences_in_one_flat_batch(pair, lm):
    """A decode token of one sequence and a prefill of another, laid end to end in one step."""
    ref, cfg, ours = pair
    from computron.models.kvcache import paged_batch

    a, b = IDS[:9], IDS[4:12]
    pool, blocks = lm.new_cache(cfg, capacity=64)
    cache_a, cache_b = (pool, blocks[::2]), (pool, blocks[1::2])  # interleaved blocks of one pool
    lm.step(ours, a[:-1], 0, cache_a)
    batch = paged_batch(pool, [(cache_a[1], len(a) - 1, 1), (cache_b[1], 0, len(b))], "cpu")
    with torch.no_grad():
        got = ours(torch.tensor(a[-1:] + b), torch.tensor([len(a) - 1, *range(len(b))]), batch)
    torch.testing.assert_close(got[0], _ref_logits(ref, a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1:], _ref_logits(ref, b), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_generate(pair, lm):
    ref, cfg, ours = pair
    prompt, n_new = IDS[:5], 10
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    cache, tokens = lm.new_cache(cfg), []
    logits = lm.step(ours, prompt, 0, cache)
    for past in range(len(prompt), len(prompt) + n_new):
        tokens.append(int(logits[-1].argmax()))
        logits = lm.step(ours, tokens[-1:], past, cache)
    assert tokens == want


def test_sharded_checkpoint_loads(tmp_path, lm):
    ref = _save("llama-gqa", tmp_path, lm.randomize, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg, ours = lm.load_ours(tmp_path)
    torch.testing.assert_close(lm.step(ours, IDS, 0, lm.new_cache(cfg)), _ref_logits(ref, IDS),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_read_config_fields(kind, tmp_path):
    from computron.models import read_config

    CONFIGS[kind]().save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    hf = CONFIGS[kind]()
    assert cfg.name == tmp_path.name and cfg.num_layers == 2 and cfg.hidden_size == 64 and cfg.vocab_size == 96
    assert cfg.dtype in ("float16", "float32")  # float16 unless config.json stores a dtype
    assert read_config(tmp_path, dtype="bfloat16").dtype == "bfloat16"
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    if kind == "llama-gqa":
        assert (cfg.kv_heads, cfg.rope_theta, cfg.family, cfg.norm) == (2, 500000.0, "llama", "rmsnorm")
    if kind == "opt-postnorm-proj":
        assert (cfg.pre_norm, cfg.final_norm, cfg.embed_proj_dim, cfg.position_offset) == (False, False, 32, 2)
    if kind == "gpt2":
        assert (cfg.ffn_size, cfg.activation) == (256, "gelu_new")
