"""Striped swap-in on the CPU: the deal of a model's image over several links covers every byte once,
the striped swapper lands the image byte for byte with helpers' staging borrowed only during a swap,
and an engine swapping through stripes gives the tokens of one that does not."""

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, EngineError, SamplingParams
from computron.memory.arena import Arena
from computron.memory.host import HostImage
from computron.memory.layout import layout_for
from computron.memory.striped import StripedSwapper, deal
from computron.models import resolve_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_deal_covers_every_byte_once_and_turns_the_links_across_groups():
    groups = [(0, 100), (100, 105), (105, 300), (300, 301)]
    plan = deal(groups, links=3, chunk=40)
    for (lo, hi), parts in zip(groups, plan):
        assert [a for _, a, _ in parts] == list(range(lo, hi, 40))  # in order, from the group's start
        assert parts[-1][2] == hi and all(b - a <= 40 for _, a, b in parts)
        assert all(b == a2 for (_, _, b), (_, a2, _) in zip(parts, parts[1:]))  # no gap, no overlap
    links = [link for parts in plan for link, _, _ in parts]
    assert links == [i % 3 for i in range(len(links))]  # one turn through all groups
    assert deal(groups, links=1, chunk=1000) == [[(0, lo, hi)] for lo, hi in groups]
    with pytest.raises(ValueError, match="at least one link and a positive chunk"):
        deal(groups, links=0)


def test_striped_swap_lands_the_image_byte_for_byte_and_returns_the_staging():
    cfg, _ = resolve_model("tiny-llama")
    image = HostImage(layout_for(cfg), pin=False)
    image.fill_random(cfg, 3)
    arena = Arena(2 * image.nbytes, "cpu")
    sw = StripedSwapper(arena, [torch.device("cpu")] * 2, chunk=4096)
    assert sw.borrowed() == {"cpu": 0}  # nothing held between swaps
    links = {link for parts in deal(image.layout.groups, 3, 4096) for link, _, _ in parts}
    assert links == {0, 1, 2}  # every link carries chunks of this image
    region, swap = sw.swap_in("m", image)
    assert torch.equal(region.tensor, image.buffer) and swap.done() and swap.seconds() > 0
    assert all(h.borrowed == 0 for h in sw.helpers)
    with pytest.raises(ValueError, match="two staging slots"):
        StripedSwapper(arena, [torch.device("cpu")], slots=1)


def test_engine_swapping_through_stripes_gives_the_tokens_of_a_plain_one():
    def engine(**kw):
        eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=50_000 + 900_000, workspace_bytes=50_000, **kw))
        for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"):
            eng.register_model(m)
        return eng

    plain, striped = engine(), engine(stripe_devices=[1, 2])
    assert type(striped.executor.swapper).__name__ == "StripedSwapper"
    jobs = [(m, p) for p in ("hello", "swap me") for m in ("tiny-opt", "tiny-llama", "tiny-gpt2")]
    want = [plain.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert [striped.generate(m, p, GREEDY).output_ids for m, p in jobs] == want
    assert striped.stats["swap_ins"] == len(jobs)  # each request swapped its model in, through stripes


def test_stripe_devices_are_checked():
    with pytest.raises(ValueError, match="distinct device indexes"):
        EngineConfig(stripe_devices=[1, 1])
    with pytest.raises(EngineError, match=r"stripe_devices \[2\]: under workers a helper is one of the engine's 2"):
        Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=2**24,
                            stripe_devices=[2]))
    with pytest.raises(EngineError, match="this executor copies through one link \\(the legacy executor"):
        Engine(EngineConfig(device="cpu", policy="computron", gpu_memory_budget=2**24, stripe_devices=[1]))
