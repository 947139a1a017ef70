"""KV caches moved to pinned host memory and back on a CUDA GPU (``kv_host_bytes``): the same tokens as
undisturbed runs, and the copies really happened. Run on the lent GPU machine: `pytest -m gpu tests/gpu`."""

import math

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORKSPACE = 64 * 2**20
NEW = 40
PARAMS = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True)]
JOBS = [("tiny-opt", list(range(5 + i, 25 + i)), sp) for i, sp in enumerate(PARAMS)] + \
       [("tiny-llama", list(range(7 + i, 19 + i)), sp) for i, sp in enumerate(PARAMS)]


def _capacity() -> int:
    """Room for tiny-opt and its two caches, or tiny-llama and its two, but not tiny-llama beside all four
    caches: when tiny-llama's requests stop tiny-opt's, tiny-opt's caches must leave the device."""
    probe = Engine(EngineConfig(device="cuda", gpu_memory_budget=2**30, workspace_bytes=WORKSPACE))
    for m in ("tiny-opt", "tiny-llama"):
        probe.register_model(m)
    s = probe.core.scheduler
    bt = s.config.block_tokens
    caches = {m: sum(math.ceil((len(p) + NEW) / bt) * s.models[m].block_bytes[0] for mm, p, _ in JOBS if mm == m)
              for m in ("tiny-opt", "tiny-llama")}
    alone = max(s.models[m].weights[0] + caches[m] for m in caches)
    crowded = s.models["tiny-llama"].weights[0] + caches["tiny-llama"] + caches["tiny-opt"]
    assert alone < crowded, (alone, crowded)
    return (alone + crowded) // 2


@pytest.mark.parametrize("executor", ["inprocess", "workers"])
def test_caches_moved_to_host_and_back_on_a_gpu_match_undisturbed_runs(executor):
    ref = Engine(EngineConfig(device="cuda", gpu_memory_budget=2**30, workspace_bytes=WORKSPACE))
    for m in ("tiny-opt", "tiny-llama"):
        ref.register_model(m)
    want = [ref.generate(m, p, sp).output_ids for m, p, sp in JOBS]
    capacity = _capacity()
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=WORKSPACE + capacity, workspace_bytes=WORKSPACE,
                              policy="preempt", max_wait_s=0.0, preempt_keeps_kv=True, kv_host_bytes=2**20,
                              executor=executor))
    try:
        for m in ("tiny-opt", "tiny-llama"):
            eng.register_model(m)
        reqs = [eng.submit(*job) for job in JOBS[:2]]
        for _ in range(3):
            eng.step()
        reqs += [eng.submit(*job) for job in JOBS[2:]]
        while not all(r.done for r in reqs):
            eng.step()
            mem = eng.memory()["devices"][0]
            assert mem["kv"] + mem["weights"] == mem["scheduled"] <= mem["capacity"]
        assert [(r.finish_reason, r.error) for r in reqs] == [("length", None)] * 4
        assert [r.output_ids for r in reqs] == want
        st = eng.stats
        assert st["kv_offloaded"] > 0 and st["kv_restored"] == st["kv_offloaded"] and st["kv_moved_bytes"] > 0
        assert st["preemptions"] == 0 and st["prefill_tokens"] == sum(len(p) for _, p, _ in JOBS)
        assert eng.memory()["kv"] == 0 and eng.core.scheduler.host_used == 0
    finally:
        eng.executor.shutdown()
