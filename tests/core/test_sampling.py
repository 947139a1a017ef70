"""The batched sampler on the CPU: which tokens can be drawn, how often, and reproducibility.

Every test is deterministic: seeded rows use their own generators, unseeded rows the default
generator after ``torch.manual_seed``.
"""

import math

import pytest
import torch

from computron.engine.sampling import sample
from computron.messages import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]  # sorted: prefix masses 0.5, 0.8, 0.95, 1.0


def gen(seed):
    return torch.Generator().manual_seed(seed)


def drawn(row, n=400, **kw):
    """The set of tokens drawn from one logits row by ``n`` rows in one batch, each seeded differently."""
    p = SamplingParams(**kw)
    tokens = sample(row.expand(n, -1).clone(), [p] * n, [gen(s) for s in range(n)])
    assert tokens.dtype == torch.long and tokens.shape == (n,)
    return set(tokens.tolist())


def test_top_k_draws_exactly_the_k_largest():
    row = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 1.0, -0.5, 0.7])  # ranks: 1, 3, 5, 7, 0, 6, 4, 2
    order = row.argsort(descending=True).tolist()
    for k in (1, 2, 3, 5):
        assert drawn(row, top_k=k) == set(order[:k]), k
    assert drawn(row, top_k=8) == set(range(8))
    assert drawn(row, top_k=100) == set(range(8))  # k above the vocabulary: no truncation
    assert drawn(row, top_k=0) == set(range(8))  # 0: off


@pytest.mark.parametrize("perm", [None, [2, 0, 3, 1], [3, 2, 1, 0], [1, 3, 0, 2]])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(perm):
    probs = torch.tensor(PROBS)
    tokens = list(range(4))
    if perm is not None:  # vocabulary not in sorted order: the mask must be un-sorted
        probs = torch.empty(4).scatter_(0, torch.tensor(perm), probs)  # token perm[i] has PROBS[i]
        tokens = perm
    row = probs.log()
    assert drawn(row, top_p=0.4) == {tokens[0]}  # the top token always survives
    assert drawn(row, top_p=0.6) == set(tokens[:2])
    assert drawn(row, top_p=0.8) == set(tokens[:2])  # {0, 1} has mass 0.8: it reaches 0.8
    assert drawn(row, top_p=0.81) == set(tokens[:3])
    assert drawn(row, top_p=0.96) == set(tokens)
    assert drawn(row, top_p=1.0) == set(tokens)


def test_top_k_and_top_p_together():
    # Six tokens with probabilities 0.3, 0.25, 0.2, 0.15, 0.07, 0.03, scattered over the vocabulary.
    perm = [4, 1, 5, 0, 3, 2]
    row = torch.empty(6).scatter_(0, torch.tensor(perm), torch.tensor([0.3, 0.25, 0.2, 0.15, 0.07, 0.03]).log())
    assert drawn(row, top_k=4) == set(perm[:4])
    assert drawn(row, top_p=0.86) == set(perm[:4])  # top-p alone: mass before the 5th is 0.9
    assert drawn(row, top_p=0.91) == set(perm[:5])
    # top-p applies to the distribution left by top-k: 0.3, 0.25, 0.2, 0.15 renormalised by 0.9 are
    # 0.333, 0.278, 0.222, 0.167, prefix masses 0.333, 0.611, 0.833, 1.
    assert drawn(row, top_k=4, top_p=0.6) == set(perm[:2])
    assert drawn(row, top_k=4, top_p=0.62) == set(perm[:3])
    assert drawn(row, top_k=3, top_p=0.99) == set(perm[:3])  # top-k binds
    assert drawn(row, top_k=5, top_p=0.3) == {perm[0]}  # top-p binds
    assert drawn(row, top_k=1, top_p=0.99) == {perm[0]}


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 50) * 3
    best = logits.argmax(-1)
    for t in (0.0, 1e-6):  # below GREEDY_BELOW: argmax, never a division by ~0
        p = SamplingParams(temperature=t, top_k=3, top_p=0.5, seed=1)
        assert torch.equal(sample(logits, [p] * 16, [gen(i) for i in range(16)]), best)
        assert torch.equal(sample(logits, [p] * 16, [None] * 16), best)
    # A small temperature above the threshold is a sharp softmax, not an overflow: still the argmax.
    p = SamplingParams(temperature=1e-4)
    assert torch.equal(sample(logits, [p] * 16, [gen(i) for i in range(16)]), best)


@pytest.mark.parametrize("kw, expect", [
    ({}, None),  # plain softmax
    ({"temperature": 0.5}, None),  # softmax of logits / 0.5
    ({"temperature": 2.0}, None),
    ({"top_k": 3}, [1.0, 0.0, 1.0, 1.0]),  # renormalised over the 3 largest
    ({"top_p": 0.7}, [0.0, 0.0, 1.0, 1.0]),  # softmax masses ~.09 .03 .24 .64: keep {3, 2}
])
def test_frequencies_match_the_distribution(kw, expect):
    logits = torch.tensor([1.0, 0.0, 2.0, 3.0])
    p = SamplingParams(**kw)
    probs = (logits / p.temperature).softmax(-1)
    if expect is not None:
        probs = probs * torch.tensor(expect)
        probs = probs / probs.sum()
    n = 20_000
    torch.manual_seed(1234)  # unseeded rows: the default generator, one draw for the whole batch
    tokens = sample(logits.expand(n, -1).clone(), [p] * n, [None] * n)
    freq = torch.bincount(tokens, minlength=4).double() / n
    tol = 4 * math.sqrt(0.25 / n)  # 4 standard deviations at the worst p = 0.5
    assert torch.allclose(freq, probs.double(), atol=tol), (freq, probs)
    assert set(tokens.tolist()) == {i for i in range(4) if probs[i] > 0}


def test_seeded_rows_draw_with_their_own_generator_frequencies():
    logits = torch.tensor([0.0, 1.0, 2.0])
    n = 5000
    tokens = sample(logits.expand(n, -1).clone(), [SamplingParams(seed=1)] * n, [gen(s) for s in range(n)])
    freq = torch.bincount(tokens, minlength=3).double() / n
    assert torch.allclose(freq, logits.softmax(-1).double(), atol=4 * math.sqrt(0.25 / n))


def _sequence_in_batch(seed, pos, batch, steps=30, V=64):
    """The tokens the request seeded ``seed`` draws over ``steps`` steps when it sits at row ``pos``
    of a batch of ``batch`` rows, the other rows being seeded differently, unseeded or greedy. The
    request's own logits at each step are the same whatever the batch; the others are random."""
    mine = torch.Generator().manual_seed(99)
    own_logits = [torch.randn(V, generator=mine) * 2 for _ in range(steps)]
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)]
    others = [SamplingParams(seed=1000 + i) if i % 3 == 0 else SamplingParams(temperature=0.0) if i % 3 == 1
              else SamplingParams(top_k=5) for i in range(batch - 1)]
    params = others[:pos] + params + others[pos:]
    gens = [gen(p.seed) if p.seed is not None else None for p in params]
    torch.manual_seed(batch * 7 + pos)  # the default generator differs from run to run
    out = []
    for step in range(steps):
        logits = torch.randn(batch, V) * 2
        logits[pos] = own_logits[step]
        out.append(sample(logits, params, gens)[pos].item())
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    alone = _sequence_in_batch(seed=7, pos=0, batch=1)
    assert len(set(alone)) > 5  # it does sample
    for pos, batch in [(0, 4), (3, 4), (2, 9), (8, 9), (5, 17)]:
        assert _sequence_in_batch(seed=7, pos=pos, batch=batch) == alone, (pos, batch)
    assert _sequence_in_batch(seed=8, pos=0, batch=1) != alone  # and the seed matters


def test_mixed_batch_of_greedy_and_sampled_rows():
    torch.manual_seed(3)
    B, V = 12, 30
    logits = torch.randn(B, V) * 2
    params, gens = [], []
    for i in range(B):
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0.0, top_k=2))
            gens.append(gen(i) if i % 4 == 0 else None)
        else:
            params.append(SamplingParams(temperature=1.5, top_k=3, seed=i))
            gens.append(gen(i))
    seen = [set() for _ in range(B)]
    for _ in range(200):
        tokens = sample(logits, params, gens)
        assert tokens.shape == (B,) and tokens.dtype == torch.long and tokens.device == logits.device
        for i, t in enumerate(tokens.tolist()):
            seen[i].add(t)
    for i in range(B):
        top = set(logits[i].topk(3).indices.tolist())
        if i % 2 == 0:
            assert seen[i] == {logits[i].argmax().item()}
        else:
            assert seen[i] == top  # sampled rows stay within their top-3, and reach all of it


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 10)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.7, top_k=4, top_p=0.8)] * 3, [gen(1), None, gen(2)])
    assert torch.equal(logits, before)
