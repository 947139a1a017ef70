"""A checkpoint saved by `transformers` serves through the whole engine, swaps included."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from computron.config import EngineConfig, ModelSpec  # noqa: E402
from computron.engine import Engine, EngineError, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_saver):
    return hf_saver(tmp_path_factory, {
        "opt": transformers.OPTConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32),
        "llama": transformers.LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                          max_position_embeddings=128),
    })


def test_checkpoint_greedy_tokens_match_transformers_through_swaps(checkpoints):
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=50_000 + 200_000, workspace_bytes=50_000))
    for name, (path, _) in checkpoints.items():
        eng.register_model(ModelSpec(str(path), alias=name, dtype="float32"))
    prompt = [5, 17, 42, 99, 7]
    for _ in range(2):  # twice round: each model is evicted and swapped back in
        for name, (_, hf) in checkpoints.items():
            ours = eng.generate(name, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert ours.output_ids == ref[0, len(prompt):].tolist(), name
    assert eng.stats["swap_ins"] == 4 and eng.stats["evictions"] == 3


def test_corrupt_checkpoint_is_refused_with_the_file_named(checkpoints, tmp_path):
    import shutil

    src, _ = checkpoints["opt"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=2**24))
    with pytest.raises(Exception, match="model.safetensors"):
        eng.register_model(ModelSpec(str(bad), dtype="float32"))
    assert not eng.models
    with pytest.raises(EngineError, match="neither a checkpoint directory nor a preset"):
        eng.register_model(ModelSpec(str(tmp_path / "missing")))
