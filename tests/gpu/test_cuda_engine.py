"""The engine on a CUDA GPU: run on the lent GPU machine with `pytest -m gpu tests/gpu`."""

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(budget, policy="default"):
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=budget, workspace_bytes=64 * 2**20, policy=policy))
    for m in MODELS:
        eng.register_model(m)
    return eng


def test_swaps_on_gpu_match_resident_run():
    big, small = _engine(2**30), _engine(64 * 2**20 + 900_000)
    jobs = [(MODELS[i % 3], f"prompt {i}") for i in range(9)]
    ref = [big.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert [small.generate(m, p, GREEDY).output_ids for m, p in jobs] == ref
    assert small.stats["swap_ins"] == 9 and small.stats["evictions"] == 8
    assert small.executor.arena.buffer.is_cuda


def test_gpu_tokens_match_cpu_on_the_same_weights_and_survive_a_reload():
    gpu = _engine(2**30)
    cpu = Engine(EngineConfig(device="cpu", gpu_memory_budget=2**30))
    for m in MODELS:
        cpu.register_model(m)
        # Presets draw their weights on the serving device; give the CPU engine the GPU's bytes.
        cpu.executor.models[m].image.buffer.copy_(gpu.executor.models[m].image.buffer)
    for m in MODELS:
        a = gpu.generate(m, "abc", GREEDY).output_ids
        assert a == cpu.generate(m, "abc", GREEDY).output_ids, m
        gpu.offload(m)
        assert gpu.model_state(m) == "offloaded"
        assert gpu.generate(m, "abc", GREEDY).output_ids == a


def test_per_layer_events_let_compute_start_before_copy_ends():
    eng = _engine(2**30)
    eng.load("tiny-opt")
    swap = eng.executor.resident["tiny-opt"].swap
    assert swap.events is not None and len(swap.events) == eng.models["tiny-opt"].cfg.num_layers + 2
    eng.generate("tiny-opt", "x", GREEDY)
    assert eng.executor.resident["tiny-opt"].swap is None


def test_computron_policy_on_gpu():
    legacy, ref = _engine(2**30, policy="computron"), _engine(2**30)
    jobs = [(MODELS[i % 3], f"p{i}") for i in range(6)]
    assert [legacy.generate(m, p, GREEDY).output_ids for m, p in jobs] == \
           [ref.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert legacy.stats["evictions"] == 5
    host = legacy.executor.host["tiny-opt"]
    assert all(t.is_pinned() for t in host.values())  # pinned by the asynchronous copy-back


def test_host_images_are_pinned_by_registration_and_released():
    import gc

    from computron.memory.host import host_buffer

    buf = host_buffer(64 * 2**20, pin=True)
    assert buf.is_pinned()
    eng = _engine(2**30)
    assert all(m.image.buffer.is_pinned() for m in eng.executor.models.values())
    del buf
    gc.collect()  # the registration ends with the buffer: nothing raises at unregister


def test_evicting_a_model_whose_copy_is_in_flight_waits_for_the_copy():
    """A prefetch evicted at once: its region is reused only after its copy has landed, so the
    compute stream can never write KV cache into memory the copy engine still fills."""
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=4 * 2**30, workspace_bytes=64 * 2**20))
    eng.register_model("opt-350m")  # ~0.66 GB: a copy of ~12 ms, far longer than the calls below
    eng.register_model("tiny-opt")
    ref = eng.generate("tiny-opt", "abc", GREEDY).output_ids
    eng.load("opt-350m")
    swap = eng.executor.resident["opt-350m"].swap
    assert not swap.events[-1].query()  # still copying
    eng.offload("opt-350m")
    assert swap.events[-1].query()  # the eviction waited for it
    assert eng.generate("tiny-opt", "abc" * 40, GREEDY).output_ids and eng.generate("tiny-opt", "abc", GREEDY).output_ids == ref
