"""Colocation's memory handover through the engine: a smaller share evicts idle models and shrinks
the executor's arena to it (compacting what stays); a larger one grows the arena again first.
Tokens are those of an engine that never changed size."""

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]


def capacity(eng: Engine) -> int:
    """What the arena spans now (its ceiling stays ``status().devices[0].capacity``)."""
    return eng.memory()["devices"][0]["held"]


def test_share_changes_move_the_arena_and_keep_tokens():
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=8 * 2**20, workspace_bytes=50_000))
    for m in MODELS:
        ref.register_model(m)
        eng.register_model(m)
    want = {m: ref.generate(m, "the quick brown fox", GREEDY).output_ids for m in MODELS}
    full = capacity(eng)
    for m in MODELS:  # all three resident
        assert eng.generate(m, "the quick brown fox", GREEDY).output_ids == want[m]
    one = eng.models["tiny-llama"].nbytes + 64 * 2**10  # room for one model and its cache
    before = eng.stats["evictions"]
    eng.core.set_budget(0, one)
    assert eng.stats["evictions"] - before == 2 and capacity(eng) == one
    assert eng.generate("tiny-llama", "the quick brown fox", GREEDY).output_ids == want["tiny-llama"]
    eng.core.set_budget(0, full)
    assert capacity(eng) == full
    for m in MODELS:
        assert eng.generate(m, "the quick brown fox", GREEDY).output_ids == want[m]


def test_a_running_request_finishes_in_a_smaller_arena_then_an_empty_share_empties_it():
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=8 * 2**20, workspace_bytes=50_000))
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=8 * 2**20, workspace_bytes=50_000))
    for e in (ref, eng):
        e.register_model("tiny-llama")
    want = ref.generate("tiny-llama", "the quick brown fox", GREEDY).output_ids
    req = eng.submit("tiny-llama", "the quick brown fox", GREEDY)
    eng.step(); eng.step()
    need = eng.core.scheduler.need_bytes(0)  # the weights and the cache at full length
    eng.core.set_budget(0, need)
    assert capacity(eng) == need < capacity(ref)
    eng.run_until_done([req])
    assert req.output_ids == want
    eng.core.set_budget(0, 0)  # idle: the model goes, and the arena with it
    assert capacity(eng) == 0 and eng.model_state("tiny-llama") == "offloaded"


def test_the_worker_executor_resizes_its_workers_arena():
    eng = Engine(EngineConfig(device="cpu", executor="workers", gpu_memory_budget=8 * 2**20, workspace_bytes=50_000))
    try:
        eng.register_model("tiny-opt")
        want = eng.generate("tiny-opt", "abc", GREEDY).output_ids
        need = eng.models["tiny-opt"].nbytes + 64 * 2**10
        eng.core.set_budget(0, need)
        assert capacity(eng) == need
        assert eng.generate("tiny-opt", "abc", GREEDY).output_ids == want
    finally:
        eng.executor.shutdown()
