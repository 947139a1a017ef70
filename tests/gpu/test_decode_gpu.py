"""Fast decode on a CUDA GPU: batched and graph-replayed decode give the tokens of the plain paths.
Run on the lent GPU machine: `pytest -m gpu tests/gpu`."""

import pytest
import torch

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(graphs: bool, models=("tiny-opt", "tiny-llama"), budget=2**30, decode_steps=1):
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=budget, workspace_bytes=256 * 2**20,
                              cuda_graphs=graphs, decode_steps=decode_steps))
    for m in models:
        eng.register_model(m)
    return eng


def _prompts(n):
    return [list(range(3 + i, 3 + i + 5 + 3 * i % 17)) for i in range(n)]


@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
def test_batch_32_equals_batch_1_in_fp32_and_graph_replay_equals_eager(model):
    eager, graphed = _engine(False), _engine(True)
    prompts = _prompts(32)
    alone = [eager.generate(model, p, GREEDY).output_ids for p in prompts]
    for eng in (eager, graphed):
        reqs = [eng.submit(model, p, GREEDY) for p in prompts]
        eng.run_until_done(reqs)
        assert [r.output_ids for r in reqs] == alone
    five = [graphed.submit(model, p, GREEDY) for p in prompts[:5]]  # a padded bucket (8)
    graphed.run_until_done(five)
    assert [r.output_ids for r in five] == alone[:5]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    assert graphed.generate(model, prompts[0], seeded).output_ids == eager.generate(model, prompts[0], seeded).output_ids


@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
def test_runs_of_graph_replays_fed_on_the_device_equal_single_eager_steps(model):
    """decode_steps=8: each run stages its inputs once and feeds each step's tokens to the next
    replay on the device; tokens equal single eager steps, greedy and seeded, in padded buckets,
    across KV-block boundaries."""
    eager, runs = _engine(False), _engine(True, decode_steps=8)
    prompts = _prompts(12)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0 if i % 2 else 0.9, top_k=0 if i % 3 else 20,
                             top_p=0.9, seed=i, ignore_eos=True) for i in range(12)]
    want = [eager.submit(model, p, sp) for p, sp in zip(prompts, params)]
    eager.run_until_done(want)
    got = [runs.submit(model, p, sp) for p, sp in zip(prompts, params)]
    runs.run_until_done(got)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert runs.executor.status().stats["graph_captures"] >= 1


def test_graphs_survive_swaps_and_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    # A budget for one model: every round evicts the other and swaps this one back in.
    eng = _engine(True, models=("tiny-opt",), budget=256 * 2**20 + 800_000)  # ~0.65 + ~0.45 MB of weights
    eng.register_model(ModelSpec(str(tmp_path), alias="ckpt", dtype="float32"))
    prompt = [5, 17, 42, 99, 7]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, 5:].tolist()
    for _ in range(2):
        assert eng.generate("ckpt", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)).output_ids == want
        eng.generate("tiny-opt", prompt, GREEDY)
    assert eng.stats["swap_ins"] == 4


def test_graphs_captured_again_where_the_weights_moved_give_the_same_tokens():
    """Three copies of a model, room for two: round robin puts a copy back at another address each
    time, so its graphs are captured again there (without the first capture's warm-up) and must
    still give the eager tokens."""
    probe = _engine(False, models=())
    probe.register_model(ModelSpec("tiny-opt", alias="a"))
    room = 256 * 2**20 + int(2.5 * probe.models["a"].nbytes)
    eng, eager = (Engine(EngineConfig(device="cuda", gpu_memory_budget=b, workspace_bytes=256 * 2**20,
                                      cuda_graphs=g)) for b, g in ((room, True), (2**30, False)))
    for e in (eng, eager):
        for alias in "abc":
            e.register_model(ModelSpec("tiny-opt", alias=alias))
    prompts = _prompts(6)
    for i, p in enumerate(prompts):
        m = "abc"[i % 3]
        assert eng.generate(m, p, GREEDY).output_ids == eager.generate(m, p, GREEDY).output_ids, (i, m)
    assert eng.stats["swap_ins"] == 6
    assert eng.executor.status().stats["graph_captures"] > 3  # some copy came back at another address
