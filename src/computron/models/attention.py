"""Batched attention over a paged key/value cache: cache writes, decode and variable-length prefill.

What flows through: one layer's cache ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size,
kv_heads, head_dim]`` (possibly strided views ``pool[:, layer, 0]``/``pool[:, layer, 1]`` of a pool
``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``; the inner three dims contiguous),
a block table ``[B, max_blocks]`` per batch (int32 or int64; entries past a sequence's last block
are ignored), ``seq_lens[B]`` (keys in cache, the new tokens included) and the queries.
Grouped-query attention reads each key/value head once for its group of query heads.

Two paths compute the same function:

- ``torch``: gathers each sequence's blocks into a padded ``[B, max_len, kv_heads, head_dim]``
  and runs masked matmul + softmax in float32. Runs anywhere; the CPU path and the tests' reference.
- ``triton``: kernels that read the blocks in place (decode: split over the keys when the batch
  alone does not fill the GPU, then one combine; prefill: flash attention over query tiles; the
  cache write: one program per token). The default on CUDA, chosen by ``bench/attention_kernels.py``.

``sdpa`` (the gathered tensors through ``scaled_dot_product_attention`` in the input dtype) is kept
as a benchmark candidate. ``impl=`` or ``COMPUTRON_ATTENTION`` (``auto``, ``torch``, ``sdpa``,
``triton``) forces a path.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

IMPLS = ("torch", "sdpa", "triton")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def write_kv(k_cache, v_cache, k, v, slots, *, impl=None) -> None:
    """Store new tokens' keys/values ``[N, kv_heads, head_dim]`` at ``slots`` (block * block_size + offset), in place;
    a slot of -1 (a padding row of a fixed-size batch) is written nowhere."""
    if _choose(k, impl) == "triton":
        return _write_triton(k_cache, v_cache, k, v, slots)
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, impl=None) -> torch.Tensor:
    """One new query per sequence: q ``[B, hq, d]`` over each sequence's ``seq_lens[b]`` cached keys → ``[B, hq, d]``
    (a row of length 0, a padding row, gives zeros on the torch and triton paths)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = _choose(q, impl)
    if impl == "triton":
        return _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, sdpa=impl == "sdpa")


def prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, cu_query, scale=None, *, impl=None) -> torch.Tensor:
    """Causal attention for a flat batch q ``[N, hq, d]``; sequence s owns rows ``cu_query[s]:cu_query[s+1]``,
    which are the last ``query_lens[s]`` of its ``seq_lens[s]`` keys (a cached past comes first) → ``[N, hq, d]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = _choose(q, impl)
    if impl == "triton":
        return _prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_query, scale)
    return _prefill_torch(q, k_cache, v_cache, block_tables, seq_lens, query_lens, cu_query, scale, sdpa=impl == "sdpa")


def _choose(q: torch.Tensor, impl: str | None) -> str:
    impl = impl or os.environ.get("COMPUTRON_ATTENTION", "auto")
    if impl == "auto":
        return "triton" if q.is_cuda and triton is not None else "torch"
    if impl not in IMPLS:
        raise ValueError(f"unknown attention path {impl!r} (auto, {', '.join(IMPLS)})")
    if impl == "triton" and triton is None:
        raise RuntimeError("the triton attention path needs the triton package")
    return impl


# ---------------------------------------------------------------- portable path (plain torch ops)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's first ``max_len`` cache slots as ``[B, max_len, kv_heads, head_dim]``; slots past
    its length are zero (the cache there may hold anything, NaN included, and 0 * NaN is NaN)."""
    bs = cache.shape[1]
    nb = _cdiv(max_len, bs)
    table = block_tables[:, :nb].long()
    lens = seq_lens[:, None].to(table.device)
    used = torch.arange(nb, device=table.device)[None, :] < (lens + bs - 1) // bs
    table = torch.where(used, table, 0)  # padding entries may hold anything
    out = cache[table].flatten(1, 2)[:, :max_len]
    valid = torch.arange(max_len, device=table.device)[None, :] < lens
    return out.masked_fill(~valid[:, :, None, None], 0)


def _attend(q, k, v, mask, scale, sdpa):
    """q ``[B, hk, M, d]`` (M rows per key/value head), k/v ``[B, L, hk, d]``, mask ``[B, M or 1, L]`` → ``[B, hk, M, d]``."""
    k, v, mask = k.transpose(1, 2), v.transpose(1, 2), mask[:, None]
    if sdpa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(dim=-1).nan_to_num(0.0)  # no keys (length 0): zeros
    return torch.matmul(p, v.float()).to(q.dtype)


def _decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, sdpa=False, max_len=None):
    B, hq, d = q.shape
    hk = k_cache.shape[2]
    max_len = max_len or int(seq_lens.max())
    k, v = (gather_kv(c, block_tables, seq_lens, max_len) for c in (k_cache, v_cache))
    mask = (torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device))[:, None, :]
    return _attend(q.view(B, hk, hq // hk, d), k, v, mask, scale, sdpa).reshape(B, hq, d)


def _prefill_torch(q, k_cache, v_cache, block_tables, seq_lens, query_lens, cu_query, scale, sdpa=False, max_q=None, max_len=None):
    N, hq, d = q.shape
    B, hk, dev = seq_lens.numel(), k_cache.shape[2], q.device
    g = hq // hk
    seq_lens, query_lens, cu_query = seq_lens.to(dev).long(), query_lens.to(dev).long(), cu_query.to(dev).long()
    max_q, max_len = max_q or int(query_lens.max()), max_len or int(seq_lens.max())
    seq = torch.repeat_interleave(torch.arange(B, device=dev), query_lens, output_size=N)
    row = torch.arange(N, device=dev) - cu_query[seq]
    qp = q.new_zeros(B, max_q, hq, d)
    qp[seq, row] = q
    qp = qp.view(B, max_q, hk, g, d).transpose(1, 2).reshape(B, hk, max_q * g, d)  # rows (position, group head)
    pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=dev)  # [B, max_q]
    keys = torch.arange(max_len, device=dev)
    mask = (keys <= pos[:, :, None]) & (keys < seq_lens[:, None, None])
    k, v = (gather_kv(c, block_tables, seq_lens, max_len) for c in (k_cache, v_cache))
    o = _attend(qp, k, v, mask.repeat_interleave(g, dim=1), scale, sdpa)
    return o.view(B, hk, max_q, g, d).transpose(1, 2).reshape(B, max_q, hq, d)[seq, row]


# ---------------------------------------------------------------- Triton path (reads blocks in place)

_PREC = {torch.float32: "ieee"}
_MAX_SPLITS = 64
# Triton compiles a kernel for every new value of a constexpr (and of an int argument that is 1 or not),
# a few hundred milliseconds each, on the serving thread, in the middle of a step. So the sizes that
# vary from step to step are rounded up to floors that cover the usual batches: the prefill's number of
# sequences (BP >= 64, ``B`` not specialised) and the decode's key splits (SP >= 16) compile once.


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _splits(programs: int, capacity: int, device: torch.device) -> int:
    """Key splits per (sequence, kv head): enough programs for two waves, at least 128 keys each."""
    return max(1, min(_cdiv(2 * _sm_count(device), programs), _cdiv(capacity, 128), _MAX_SPLITS))


def _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None, block_n=64, num_warps=4):
    B, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    g = hq // hk
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    capacity = block_tables.shape[1] * bs  # an upper bound on seq_lens that needs no device sync
    splits = num_splits or _splits(B * hk, capacity, q.device)
    chunk = _cdiv(_cdiv(capacity, splits), block_n) * block_n  # keys per split, whole tiles
    splits = _cdiv(capacity, chunk)
    out = torch.empty_like(q)
    if splits == 1:
        part, lse = out, out
        sp, sl = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part = torch.empty(B, hq, splits, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, hq, splits, device=q.device, dtype=torch.float32)
        sp, sl = part.stride()[:3], lse.stride()[:2]
    common = dict(G=g, GP=max(16, triton.next_power_of_2(g)), D=d, DP=triton.next_power_of_2(d))
    _decode_kernel[(B, hk, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, scale * 1.4426950408889634, chunk,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), *sp, *sl,
        BS=bs, BN=block_n, SPLIT=splits > 1, PREC=_PREC.get(q.dtype, "tf32"), **common, num_warps=num_warps, num_stages=2,
    )
    if splits > 1:
        _combine_kernel[(B, hq)](
            part, lse, out, splits, *part.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            D=d, DP=common["DP"], SP=max(16, triton.next_power_of_2(splits)), num_warps=4,
        )
    return out


def _prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_query, scale, block_m=64, block_n=64, num_warps=4):
    N, hq, d = q.shape
    B, bs, hk = seq_lens.numel(), k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    out = torch.empty_like(q)
    tiles = _cdiv(N, block_m) + B  # an upper bound on sum(ceil(query_lens / block_m)), no device sync
    _prefill_kernel[(hq, tiles)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_query, out, scale * 1.4426950408889634, B,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=hq // hk, D=d, DP=triton.next_power_of_2(d), BS=bs, BM=block_m, BN=block_n,
        BP=max(64, triton.next_power_of_2(B)), PREC=_PREC.get(q.dtype, "tf32"), num_warps=num_warps, num_stages=2,
    )
    return out


def _write_triton(k_cache, v_cache, k, v, slots):
    N, hk, d = k.shape
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if N:
        _write_kernel[(N,)](
            k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            H=hk, HP=triton.next_power_of_2(hk), D=d, DP=triton.next_power_of_2(d), BS=k_cache.shape[1], num_warps=4,
        )


if triton is not None:

    @triton.jit
    def _write_kernel(K, V, KC, VC, SLOTS, s_kn, s_kh, s_vn, s_vh, s_cb, s_ct, s_ch, s_db, s_dt, s_dh,
                      H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(SLOTS + i).to(tl.int64)
        blk, off = slot // BS, slot % BS
        h, d = tl.arange(0, HP), tl.arange(0, DP)
        m = (h < H)[:, None] & (d < D)[None, :] & (slot >= 0)  # slot -1: a padding row, written nowhere
        k = tl.load(K + i * s_kn + h[:, None] * s_kh + d[None, :], mask=m)
        tl.store(KC + blk * s_cb + off * s_ct + h[:, None] * s_ch + d[None, :], k, mask=m)
        v = tl.load(V + i * s_vn + h[:, None] * s_vh + d[None, :], mask=m)
        tl.store(VC + blk * s_db + off * s_dt + h[:, None] * s_dh + d[None, :], v, mask=m)

    @triton.jit
    def _decode_kernel(Q, K, V, BT, LENS, O, LSE, qk_scale, chunk,
                       s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                       BN: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr):
        b, kh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(LENS + b).to(tl.int32)
        start = sp * chunk
        end = tl.minimum(start + chunk, seq_len)
        g, d = tl.arange(0, GP), tl.arange(0, DP)
        heads, dm = kh * G + g, d < D
        hm = (g < G)[:, None] & dm[None, :]
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hm, other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for n0 in range(start, end, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < end
            page = tl.load(BT + b * s_bt + n // BS, mask=nm, other=0).to(tl.int64)
            off = n % BS
            km = nm[:, None] & dm[None, :]
            k = tl.load(K + page[:, None] * s_kb + (off * s_kt + kh * s_kh)[:, None] + d[None, :], mask=km, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * s_vb + (off * s_vt + kh * s_vh)[:, None] + d[None, :], mask=km, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        o_ptr = O + b * s_ob + heads[:, None] * s_oh + sp * s_os + d[None, :]
        if SPLIT:
            ok = l_i > 0
            tl.store(o_ptr, acc / tl.where(ok, l_i, 1.0)[:, None], mask=hm)
            tl.store(LSE + b * s_lb + heads * s_lh + sp, tl.where(ok, m_i + tl.log2(l_i), float("-inf")), mask=g < G)
        else:
            tl.store(o_ptr, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(O.dtype.element_ty), mask=hm)

    @triton.jit
    def _combine_kernel(P, LSE, O, S, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
                        D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        s, d = tl.arange(0, SP), tl.arange(0, DP)
        lse = tl.load(LSE + b * s_lb + h * s_lh + s, mask=s < S, other=float("-inf"))
        w = tl.exp2(lse - tl.maximum(tl.max(lse, 0), -1e30))  # all splits empty (length 0): w = 0, out = 0
        o = tl.load(P + b * s_pb + h * s_ph + s[:, None] * s_ps + d[None, :], mask=(s < S)[:, None] & (d < D)[None, :], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1.0)
        tl.store(O + b * s_ob + h * s_oh + d, out.to(O.dtype.element_ty), mask=d < D)

    @triton.jit(do_not_specialize=["B"])
    def _prefill_kernel(Q, K, V, BT, LENS, CU, O, qk_scale, B,
                        s_qn, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_on, s_oh,
                        G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
        h, t = tl.program_id(0), tl.program_id(1)
        kh = h // G
        # Which sequence owns query tile t: tiles are numbered sequence by sequence.
        i = tl.arange(0, BP)
        lo = tl.load(CU + i, mask=i < B, other=0).to(tl.int32)
        hi = tl.load(CU + i + 1, mask=i < B, other=0).to(tl.int32)
        tiles = (hi - lo + BM - 1) // BM
        before = tl.cumsum(tiles, 0) - tiles
        owner = (before <= t) & (t < before + tiles)
        has = tl.sum(owner.to(tl.int32), 0) > 0
        s = tl.sum(tl.where(owner, i, 0), 0)
        tile = t - tl.sum(tl.where(owner, before, 0), 0)
        q_start = tl.load(CU + s).to(tl.int32)
        q_len = tl.where(has, tl.load(CU + s + 1).to(tl.int32) - q_start, 0)
        seq_len = tl.where(has, tl.load(LENS + s).to(tl.int32), 0)
        past = seq_len - q_len
        m = tile * BM + tl.arange(0, BM)
        d = tl.arange(0, DP)
        mm, dm = m < q_len, d < D
        rows = (q_start + m).to(tl.int64)
        qm = mm[:, None] & dm[None, :]
        q = tl.load(Q + rows[:, None] * s_qn + h * s_qh + d[None, :], mask=qm, other=0.0)
        pos = past + m
        kv_end = tl.minimum(seq_len, past + tile * BM + BM)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DP], tl.float32)
        for n0 in range(0, kv_end, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < kv_end
            page = tl.load(BT + s * s_bt + n // BS, mask=nm, other=0).to(tl.int64)
            off = n % BS
            km = nm[:, None] & dm[None, :]
            k = tl.load(K + page[:, None] * s_kb + (off * s_kt + kh * s_kh)[:, None] + d[None, :], mask=km, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            sc = tl.where((n[None, :] <= pos[:, None]) & nm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * s_vb + (off * s_vt + kh * s_vh)[:, None] + d[None, :], mask=km, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + rows[:, None] * s_on + h * s_oh + d[None, :], out.to(O.dtype.element_ty), mask=qm)
