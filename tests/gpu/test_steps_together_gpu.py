"""Several models a step on a GPU (``models_per_step``): the in-process executor replays the decode
graphs of a step's models each on its own stream, and every sequence's tokens, greedy and seeded,
equal those of an engine that steps one model at a time (fp32), the steps of all three run ahead
(``engine/ahead.py``) while their batches hold."""

import pytest
import torch

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]


def _run(per_step: int):
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=256 * 2**20, workspace_bytes=32 * 2**20,
                              models_per_step=per_step, max_batch_size=8))
    for m in MODELS:
        eng.register_model(ModelSpec(m, dtype="float32"))
        eng.load(m, wait=True)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)]
    reqs = [eng.submit(m, list(range(3 + i, 11 + 2 * i)), params[i % 2]) for i, m in enumerate(MODELS * 2)]
    for _ in range(3):  # one model's requests come later: steps mix its prefill with the others' decodes
        eng.step()
    reqs.append(eng.submit("tiny-opt", list(range(40, 52)), params[0]))
    eng.run_until_done(reqs)
    return [r.output_ids for r in reqs], eng.executor.status().stats


def test_models_stepped_together_on_streams_give_the_tokens_of_one_model_a_step():
    one, stats_one = _run(1)
    three, stats = _run(3)
    assert three == one and all(len(t) == 24 for t in one)
    assert stats_one["steps_together"] == 0
    assert stats["steps_together"] >= 15  # most of the 24 decode steps ran the three models' graphs at once
    # the in-process executor on a GPU runs ahead: a step of the three models too, once the batches hold
    assert stats["run_ahead_used"] >= 10 and stats_one["run_ahead_used"] >= 10
