"""Paged attention (computron.models.attention) against per-sequence SDPA on unpaged keys/values.

CPU, float32. The Triton path joins in where it can run: on a CUDA machine, or on the CPU under
``TRITON_INTERPRET=1`` with triton installed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from computron.models import attention as A
from computron.models.attention import decode_attention, prefill_attention, write_kv

IMPLS = ["torch", "sdpa"]
if A.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    IMPLS.append("triton")
LAYERS, LAYER = 3, 1


def paged(seq_lens, hk, d, bs, g, index_dtype=torch.int64):
    """Random unpaged K/V per sequence, stored at random blocks of layer LAYER of a pool; the block table."""
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 5
    pool = torch.randn(num_blocks, LAYERS, 2, bs, hk, d, generator=g)
    kc, vc = pool[:, LAYER, 0], pool[:, LAYER, 1]
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + 2
    table = torch.randint(-(10**6), 10**6, (len(seq_lens), width), generator=g)  # padding: junk
    ks, vs, used = [], [], 0
    for s, n in enumerate(seq_lens):
        table[s, : need[s]] = perm[used : used + need[s]]
        used += need[s]
        k, v = torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)
        for j in range(n):
            kc[table[s, j // bs], j % bs] = k[j]
            vc[table[s, j // bs], j % bs] = v[j]
        ks.append(k)
        vs.append(v)
    return pool, kc, vc, table.to(index_dtype), ks, vs


def reference(q, k, v, past, scale=None):
    """q [n, hq, d] as the last n of past+n keys k/v [past+n, hk, d] → [n, hq, d], by plain SDPA."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    k, v = (t.transpose(0, 1).repeat_interleave(g, dim=0) for t in (k, v))
    mask = torch.arange(past + n)[None, :] <= past + torch.arange(n)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("bs", [16, 8])
def test_decode_matches_per_sequence_sdpa(impl, hq, hk, bs):
    g = torch.Generator().manual_seed(hq * 10 + hk + bs)
    d = 32
    seq_lens = [1, bs, 2 * bs, bs + 1, 3, *torch.randint(1, 150, (4,), generator=g).tolist()]
    _, kc, vc, table, ks, vs = paged(seq_lens, hk, d, bs, g, torch.int32 if hk == 2 else torch.int64)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    out = decode_attention(q, kc, vc, table, torch.tensor(seq_lens), impl=impl)
    assert out.shape == q.shape
    for s, n in enumerate(seq_lens):
        ref = reference(q[s : s + 1], ks[s], vs[s], n - 1)[0]
        torch.testing.assert_close(out[s], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (8, 2)])
def test_prefill_matches_per_sequence_sdpa_with_a_cached_past(impl, hq, hk):
    g = torch.Generator().manual_seed(hq + hk)
    d, bs = 32, 16
    # (past, new tokens): a fresh prompt, one token, block boundaries, a chunk after a cached past
    spec = [(0, 37), (0, 1), (16, 16), (20, 12), (0, 64), (70, 90), (5, 1)]
    seq_lens = [p + n for p, n in spec]
    query_lens = torch.tensor([n for _, n in spec])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    _, kc, vc, table, ks, vs = paged(seq_lens, hk, d, bs, g)
    q = torch.randn(int(cu[-1]), hq, d, generator=g)
    out = prefill_attention(q, kc, vc, table, torch.tensor(seq_lens), query_lens, cu, scale=0.3, impl=impl)
    assert out.shape == q.shape
    for s, (past, n) in enumerate(spec):
        ref = reference(q[cu[s] : cu[s + 1]], ks[s], vs[s], past, scale=0.3)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "sdpa"])
def test_decode_rows_of_length_zero_give_zeros(impl):
    g = torch.Generator().manual_seed(5)
    _, kc, vc, table, _, _ = paged([40, 1, 40], 2, 16, 16, g)
    q = torch.randn(3, 4, 16, generator=g)
    full = decode_attention(q, kc, vc, table, torch.tensor([40, 1, 40]), impl=impl)
    out = decode_attention(q, kc, vc, table, torch.tensor([40, 0, 40]), impl=impl)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[[0, 2]], full[[0, 2]])
    if impl == "triton":
        split = A._decode_triton(q, kc, vc, table, torch.tensor([40, 0, 40]), 0.25, num_splits=3, block_n=16)
        torch.testing.assert_close(split, out, atol=1e-5, rtol=1e-5)


def test_prefill_of_single_tokens_equals_decode():
    g = torch.Generator().manual_seed(7)
    seq_lens = [5, 16, 33]
    _, kc, vc, table, _, _ = paged(seq_lens, 2, 16, 16, g)
    q = torch.randn(3, 4, 16, generator=g)
    ones = torch.ones(3, dtype=torch.long)
    pre = prefill_attention(q, kc, vc, table, torch.tensor(seq_lens), ones, torch.arange(4), impl="torch")
    torch.testing.assert_close(pre, decode_attention(q, kc, vc, table, torch.tensor(seq_lens), impl="torch"))


@pytest.mark.parametrize("impl", ["torch", "triton"] if "triton" in IMPLS else ["torch"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_write_kv_fills_the_table_slots_of_one_layer_of_the_pool(index_dtype, impl):
    g = torch.Generator().manual_seed(3)
    nb, bs, hk, d = 9, 4, 2, 8
    pool = torch.randn(nb, LAYERS, 2, bs, hk, d, generator=g)
    before = pool.clone()
    kc, vc = pool[:, LAYER, 0], pool[:, LAYER, 1]
    assert not kc.is_contiguous()
    table = torch.tensor([[7, 2, 5], [0, 8, 3]])
    lens = [10, 5]  # sequence 0: blocks 7, 2, 5 (two slots of 5); sequence 1: blocks 0, 8
    pos = [(s, j) for s, n in enumerate(lens) for j in range(n)]
    slots = torch.tensor([int(table[s, j // bs]) * bs + j % bs for s, j in pos], dtype=index_dtype)
    k, v = torch.randn(len(pos), hk, d, generator=g), torch.randn(len(pos), hk, d, generator=g)
    write_kv(kc, vc, k, v, slots, impl=impl)
    expect = before.clone()
    for i, (s, j) in enumerate(pos):
        expect[table[s, j // bs], LAYER, 0, j % bs] = k[i]
        expect[table[s, j // bs], LAYER, 1, j % bs] = v[i]
    assert torch.equal(pool, expect)
    others = [i for i in range(LAYERS) if i != LAYER]
    assert torch.equal(pool[:, others], before[:, others])


@pytest.mark.parametrize("impl", ["torch", "triton"] if "triton" in IMPLS else ["torch"])
def test_write_kv_skips_padding_slots(impl):
    pool = torch.randn(4, LAYERS, 2, 4, 2, 8)
    before = pool.clone()
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(pool[:, LAYER, 0], pool[:, LAYER, 1], k, v, torch.tensor([5, -1, 14]), impl=impl)
    before[1, LAYER, 0, 1], before[3, LAYER, 0, 2] = k[0], k[2]
    before[1, LAYER, 1, 1], before[3, LAYER, 1, 2] = v[0], v[2]
    assert torch.equal(pool, before)


def test_write_then_attend_round_trip():
    g = torch.Generator().manual_seed(11)
    nb, bs, hk, hq, d = 12, 16, 2, 4, 16
    pool = torch.zeros(nb, LAYERS, 2, bs, hk, d)
    kc, vc = pool[:, LAYER, 0], pool[:, LAYER, 1]
    table = torch.tensor([[3, 9, 0], [11, 4, 6]])
    n = [40, 17]
    ks, vs = [torch.randn(m, hk, d, generator=g) for m in n], [torch.randn(m, hk, d, generator=g) for m in n]
    slots = torch.cat([table[s, torch.arange(m) // bs] * bs + torch.arange(m) % bs for s, m in enumerate(n)])
    write_kv(kc, vc, torch.cat(ks), torch.cat(vs), slots)
    q = torch.randn(2, hq, d, generator=g)
    out = decode_attention(q, kc, vc, table, torch.tensor(n), impl="torch")
    for s in range(2):
        torch.testing.assert_close(out[s], reference(q[s : s + 1], ks[s], vs[s], n[s] - 1)[0], atol=2e-5, rtol=2e-5)


def test_choosing_a_path():
    q = torch.zeros(1, 2, 4)
    assert A._choose(q, None if os.environ.get("COMPUTRON_ATTENTION") is None else "auto") == "torch"
    with pytest.raises(ValueError):
        A._choose(q, "nope")
