"""Model parallelism on real GPUs: one worker process per GPU joined by NCCL.

A Hugging Face checkpoint (saved by `transformers`, float32) served at tp=2, pp=2 and tp=2 x pp=2
gives the greedy tokens of the same checkpoint at tp=1, and of `transformers` itself, through swaps.
Run on a machine with 2 or 4 GPUs: `pytest -m gpu tests/gpu/test_parallel_gpu.py` (layouts needing
more GPUs than the machine has are skipped, each with its reason).
"""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from computron.config import EngineConfig, ModelSpec  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402
from computron.models import read_config  # noqa: E402
from computron.parallel.dims import ParallelDims  # noqa: E402
from computron.parallel.shard_model import rank_bytes  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the workers inherit this)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 77, 501, 8, 9, 10, 11, 12], [3]]  # not 1: OPT's pad id


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_saver):
    """An OPT and a Llama (grouped-query attention) checkpoint, 4 layers, heads and vocabulary split
    evenly, each with `transformers`' own greedy tokens of the prompts."""
    saved = hf_saver(tmp_path_factory, {
        "opt": transformers.OPTConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                                      ffn_dim=256, max_position_embeddings=256, word_embed_proj_dim=128),
        "llama": transformers.LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=4, intermediate_size=256,
                                          max_position_embeddings=256),
    })
    return {name: (path, [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False)[0, len(p):].tolist() for p in PROMPTS])
            for name, (path, model) in saved.items()}


def _tokens(checkpoints, tp: int, pp: int) -> tuple[dict, dict]:
    k = tp * pp
    # Room on each device for the larger model's shard and its cache, never for both models' shards:
    # every request of the rounds below swaps.
    shard = max(max(rank_bytes(read_config(path, "float32"), ParallelDims(tp=tp, pp=pp)))
                for path, _ in checkpoints.values())
    budget = 64 * 2**20 + shard + shard // 4 + 256 * 2**10
    eng = Engine(EngineConfig(device="cuda", executor="workers" if k > 1 else None, devices=k,
                              gpu_memory_budget=budget, workspace_bytes=64 * 2**20))
    try:
        for name, (path, _) in checkpoints.items():
            eng.register_model(ModelSpec(str(path), alias=name, dtype="float32", tp=tp, pp=pp))
        got = {name: [] for name in checkpoints}
        for _ in range(2):  # twice round: with a budget for one model, every request swaps
            for name in checkpoints:
                got[name].append([eng.generate(name, p, GREEDY).output_ids for p in PROMPTS])
        return got, dict(eng.stats)
    finally:
        eng.executor.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_checkpoint_over_nccl_gives_the_tokens_of_one_gpu(checkpoints, tp, pp):
    if tp * pp > GPUS:
        pytest.skip(f"tp={tp} x pp={pp} needs {tp * pp} GPUs, this machine has {GPUS}")
    want, _ = _tokens(checkpoints, 1, 1)
    for name, (_, ref) in checkpoints.items():
        assert want[name][0] == ref, f"{name}: tp=1 differs from transformers"
    got, stats = _tokens(checkpoints, tp, pp)
    assert got == want
    assert stats["swap_ins"] == 4 and stats["evictions"] == 3
