"""The fast paged-attention path on CUDA equals the portable one in fp16/bf16: run on the lent GPU
machine with `pytest -m gpu tests/gpu/test_attention_gpu.py`."""

import pytest
import torch

from computron.models import attention as A
from computron.models.attention import decode_attention, prefill_attention, write_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # ‖fast − portable‖ / ‖portable‖
SHAPES = [(32, 32, 64), (32, 8, 128), (16, 4, 80)]  # OPT-1.3B, Llama-3-8B, an odd head dim; hq, hk, d


def paged_cache(seq_lens, hk, d, dtype, bs=16, layers=3, layer=1, index_dtype=torch.int32):
    """Layer ``layer`` of a random pool, each sequence on random blocks; junk past each table's end."""
    need = [-(-n // bs) for n in seq_lens]
    pool = torch.randn(sum(need) + 7, layers, 2, bs, hk, d, dtype=dtype, device="cuda")
    perm = torch.randperm(pool.shape[0], device="cuda")
    table = torch.randint(10**6, 10**7, (len(seq_lens), max(need) + 3), device="cuda")
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used : used + n]
        used += n
    return pool[:, layer, 0], pool[:, layer, 1], table.to(index_dtype)


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", SHAPES)
@pytest.mark.parametrize("batch,max_len", [(1, 3000), (5, 40), (64, 600)])
def test_decode_fast_path_equals_portable(dtype, hq, hk, d, batch, max_len):
    torch.manual_seed(batch + hq + d)
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda")
    lens[0], lens[-1] = max_len, 1 if batch > 1 else max_len
    kc, vc, table = paged_cache(lens.tolist(), hk, d, dtype)
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    ref = decode_attention(q, kc, vc, table, lens, impl="torch")
    check(decode_attention(q, kc, vc, table, lens), ref, dtype)  # the default on CUDA
    check(decode_attention(q, kc, vc, table, lens, impl="triton"), ref, dtype)
    check(A._decode_triton(q, kc, vc, table, lens, d**-0.5, num_splits=1), ref, dtype)
    check(decode_attention(q, kc, vc, table, lens, impl="sdpa"), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", SHAPES)
def test_prefill_fast_path_equals_portable(dtype, hq, hk, d):
    torch.manual_seed(hq + d)
    spec = [(0, 128), (0, 1), (0, 200), (300, 77), (16, 64), (900, 124), (5, 3)]  # (past, new)
    lens = torch.tensor([p + n for p, n in spec], device="cuda")
    qlens = torch.tensor([n for _, n in spec], device="cuda", dtype=torch.int32)
    cu = torch.zeros(len(spec) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = qlens.cumsum(0)
    kc, vc, table = paged_cache(lens.tolist(), hk, d, dtype, index_dtype=torch.int64)
    q = torch.randn(int(cu[-1]), hq, d, dtype=dtype, device="cuda")
    ref = prefill_attention(q, kc, vc, table, lens, qlens, cu, impl="torch")
    check(prefill_attention(q, kc, vc, table, lens, qlens, cu), ref, dtype)
    check(prefill_attention(q, kc, vc, table, lens, qlens, cu, impl="triton"), ref, dtype)
    check(prefill_attention(q, kc, vc, table, lens, qlens, cu, impl="sdpa"), ref, dtype)


@pytest.mark.parametrize("impl", [None, "torch"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_on_cuda_touches_only_its_slots_of_its_layer(impl, slot_dtype):
    pool = torch.randn(20, 3, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    before = pool.clone()
    slots = torch.randperm(20 * 16, device="cuda")[:50]
    kv = torch.randn(50, 3 * 8 * 128, dtype=torch.bfloat16, device="cuda")  # as split from a fused projection
    k, v = kv[:, 1024:2048].view(50, 8, 128), kv[:, 2048:].view(50, 8, 128)
    write_kv(pool[:, 1, 0], pool[:, 1, 1], k, v, slots.to(slot_dtype), impl=impl)
    expect = before.clone()
    expect[slots // 16, 1, 0, slots % 16] = k
    expect[slots // 16, 1, 1, slots % 16] = v
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("splits,tile", [(1, 16), (3, 16), (6, 32), (64, 64)])
def test_triton_key_splits_and_tiles(splits, tile):
    torch.manual_seed(splits)
    seq_lens = [1, 16, 150, 77, 3]
    kc, vc, table = paged_cache(seq_lens, 2, 32, torch.float32)[:3]
    q = torch.randn(5, 8, 32, device="cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    ref = decode_attention(q, kc, vc, table, lens, impl="torch")
    torch.testing.assert_close(A._decode_triton(q, kc, vc, table, lens, 0.17678, splits, tile), ref, atol=1e-4, rtol=1e-4)
    query_lens = torch.tensor([1, 16, 100, 40, 3], device="cuda")
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), query_lens.cumsum(0)])
    q = torch.randn(int(cu[-1]), 8, 32, device="cuda")
    ref = prefill_attention(q, kc, vc, table, lens, query_lens, cu, impl="torch")
    out = A._prefill_triton(q, kc, vc, table, lens, cu, 0.17678, tile, 16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
