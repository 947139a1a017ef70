"""Striped swap-in on real GPUs (needs 2 at least): the image lands byte for byte through every
helper's link and NVLink, each layer group's event covers all its chunks, the staging goes back
after the swap, and an engine swapping through stripes gives the tokens of a plain one. Under the
worker executor (one process per GPU, NCCL): a model on GPU 0 loads through helper workers' links
(chunks relayed by point-to-point sends from the shared host image) byte for byte, and the engine
gives a plain engine's tokens (as tests/parallel/test_striped_workers.py on the CPU)."""

import time

import pytest
import torch

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams
from computron.memory.arena import Arena
from computron.memory.host import HostImage
from computron.memory.layout import layout_for
from computron.memory.striped import StripedSwapper
from computron.models import resolve_model

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_striped_image_lands_byte_for_byte_group_by_group_and_the_staging_goes_back():
    cfg, _ = resolve_model("opt-125m")
    image = HostImage(layout_for(cfg), pin=True)
    image.fill_random(cfg, 1, "cuda:0")
    arena = Arena(image.nbytes + 2**20, "cuda:0")
    helpers = [torch.device("cuda", i) for i in range(1, GPUS)]
    sw = StripedSwapper(arena, helpers, chunk=2**20)  # many chunks a group: every link's path runs
    for _ in range(2):  # the second swap reuses slots whose events were recorded by the first
        region, swap = sw.swap_in("m", image)
        for i, (lo, hi) in enumerate(image.layout.groups):
            swap.events[i].synchronize()  # once group i's event fired, its bytes are all there
            assert torch.equal(region.tensor[lo:hi].cpu(), image.buffer[lo:hi]), f"group {i}"
        assert torch.equal(region.tensor.cpu(), image.buffer)
        # every link (own, then each helper) reports when its last bytes landed: before the last group's event
        ends = [swap.start.elapsed_time(e) for e in swap.link_ends]
        assert len(ends) == GPUS and 0 < max(ends) <= swap.start.elapsed_time(swap.events[-1]) + 1e-3
        sw.swap_out(region)
    deadline = time.time() + 5
    while any(sw.borrowed().values()) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(sw.borrowed().values())


def test_engine_swapping_through_stripes_gives_the_tokens_of_a_plain_one():
    def engine(**kw):
        eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=64 * 2**20 + 900_000,
                                  workspace_bytes=64 * 2**20, **kw))
        for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"):
            eng.register_model(m)
        return eng

    plain, striped = engine(), engine(stripe_devices=list(range(1, GPUS)))
    jobs = [(m, p) for p in ("hello", "swap me") for m in ("tiny-opt", "tiny-llama", "tiny-gpt2")]
    want = [plain.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert [striped.generate(m, p, GREEDY).output_ids for m, p in jobs] == want
    assert striped.stats["swap_ins"] == len(jobs)


def _workers_config(budget: int, chunk: int, **kw) -> EngineConfig:
    return EngineConfig(device="cuda", executor="workers", devices=GPUS, gpu_memory_budget=budget,
                        workspace_bytes=64 * 2**20, stripe_devices=list(range(1, GPUS)), stripe_chunk_bytes=chunk, **kw)


def test_workers_striped_load_lands_byte_for_byte_through_helper_workers():
    from computron.engine.workers import WorkerExecutor
    from computron.messages import ModelDescription, Placement, Residency

    ex = WorkerExecutor(_workers_config(2**30, 2**20))  # 1 MiB chunks: many a group, the slots reused
    try:
        ex.register(ModelDescription("m", "opt-125m", seed=1, placement=Placement(devices=(0,))))
        want = ex.image_digest("m")
        helpers = tuple(range(1, GPUS))
        for hs in (helpers, helpers[-1:], helpers):  # the third reuses streams and pair groups
            ex.apply(Residency(load=["m"], stripes={"m": hs}))
            assert ex.weights_digest("m") == want, hs  # waits for the copies and receives to end
            ex.apply(Residency(evict=["m"]))
        deadline = time.time() + 5  # a helper's staging goes back at its next call once its sends ended
        while ex.status().stats["stripe_staging_bytes"] and time.time() < deadline:
            time.sleep(0.05)
        assert ex.status().stats["stripe_staging_bytes"] == 0
        ex.unregister("m")
    finally:
        ex.shutdown()


def test_workers_engine_loading_through_helper_workers_gives_the_tokens_of_a_plain_engine():
    plain = Engine(EngineConfig(device="cuda", gpu_memory_budget=64 * 2**20 + 900_000, workspace_bytes=64 * 2**20))
    eng = Engine(_workers_config(64 * 2**20 + 900_000, 64 * 2**10))
    try:
        for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"):
            plain.register_model(m)
            eng.register_model(ModelSpec(m, devices=[0]))  # one fits GPU 0's arena: each request swaps
        jobs = [(m, p) for p in ("hello", "swap me") for m in ("tiny-opt", "tiny-llama", "tiny-gpt2")]
        want = [plain.generate(m, p, GREEDY).output_ids for m, p in jobs]
        assert [eng.generate(m, p, GREEDY).output_ids for m, p in jobs] == want
        assert eng.stats["swap_ins"] == len(jobs) and eng.stats["striped_swap_ins"] == len(jobs)
    finally:
        eng.executor.shutdown()
