"""The arena's handover on a CUDA GPU: shrinking returns physical memory to the device (the driver
reports it free), growing takes it again, live regions keep their bytes, and an engine serving
through decode graphs gives the same tokens before and after its arena moved.
Run on the lent GPU machine: `pytest -m gpu tests/gpu`."""

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams
from computron.memory.arena import Arena

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GiB = 2**30


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_shrinking_returns_memory_to_the_device_and_growing_takes_it_again():
    arena = Arena(4 * GiB, "cuda")
    assert arena.backed == 4 * GiB  # a virtual range backed in chunks (a plain allocation would not resize)
    low = arena.allocate(256 * 2**20, "weights", "low")
    hole = arena.allocate(1 * GiB, "kv", "hole")
    high = arena.allocate(512 * 2**20, "weights", "high")  # past the end after the shrink below
    for i, r in enumerate((low, high)):
        r.tensor.copy_(torch.arange(r.nbytes, device="cuda", dtype=torch.int64).remainder(251 - i).to(torch.uint8))
    want = {r.owner: r.tensor.clone() for r in (low, high)}
    arena.release(hole)
    before = free_bytes()
    assert arena.resize(1 * GiB) == 1 * GiB
    assert arena.backed == 1 * GiB
    assert free_bytes() - before >= 3 * GiB - 64 * 2**20  # the driver has it back
    assert high.version == 1 and high.offset + high.nbytes <= 1 * GiB
    for r in (low, high):
        assert torch.equal(r.tensor, want[r.owner])
    assert arena.resize(4 * GiB) == 4 * GiB and free_bytes() <= before + 64 * 2**20
    big = arena.allocate(3 * GiB, "kv", "past the old end")
    big.tensor.fill_(7)  # the new chunks are really there
    assert int(big.tensor[-1]) == 7


def test_engine_tokens_survive_the_arena_moving_under_graphs():
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=2 * GiB, workspace_bytes=256 * 2**20))
    for m in ("tiny-opt", "tiny-llama"):
        eng.register_model(m)
    want = {m: eng.generate(m, list(range(3, 40)), greedy).output_ids for m in ("tiny-opt", "tiny-llama")}
    full = eng.executor.status().devices[0].capacity
    assert eng.memory()["devices"][0]["held"] == full
    eng.core.set_budget(0, eng.models["tiny-llama"].nbytes + 64 * 2**20)  # tiny-opt is evicted
    assert eng.executor.status().stats["arena_backed_bytes"] <= eng.models["tiny-llama"].nbytes + 128 * 2**20
    assert eng.generate("tiny-llama", list(range(3, 40)), greedy).output_ids == want["tiny-llama"]
    eng.core.set_budget(0, full)
    for m in ("tiny-opt", "tiny-llama"):
        assert eng.generate(m, list(range(3, 40)), greedy).output_ids == want[m]
