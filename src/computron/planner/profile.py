"""``plan profile``: time one Transformer layer's forward and backward on the local device.

What flows through: a TransformerShape, TP degrees and micro-batch sizes go in; a profile dict (the
file format measured.py reads) comes out, one entry per (tp, mbs) with the median forward and
backward seconds of one layer shard and the bytes it saves for backward.

The layer is a self-contained GPT/Llama-style block built from torch.nn, sharded the way
Megatron shards it over ``tp`` ranks (heads/tp query heads, K/V heads per rank, FFN/tp), with no
communication (the planner adds TP all-reduces from its own model). This is the only planner
module that imports torch, and only inside its functions.
"""

from __future__ import annotations

import datetime
import math
import platform
import re
import statistics
import time

from .measured import FORMAT, model_shape
from .model import TransformerShape


def planner_gpu_name(device_name: str, memory_bytes: float = 0.0) -> str:
    """Map a CUDA device name (``NVIDIA A100-SXM4-80GB``) to a planner GPU type name, or ``unknown``."""
    low = device_name.lower()
    for key in ("h200", "h100", "v100"):
        if key in low:
            return key
    if "a100" in low:
        return "a100-80gb" if ("80g" in low or memory_bytes > 50 * 1024**3) else "a100-40gb"
    if re.search(r"\ba10g?\b", low):
        return "a10"
    if re.search(r"\bl4\b", low):
        return "l4"
    return "unknown"


def build_layer(m: TransformerShape, tp: int, device, dtype):
    """One decoder layer's TP shard as a torch.nn.Module (pre-norm, causal self-attention, MLP)."""
    import torch
    from torch import nn

    h, d = m.hidden, m.head_dim
    nq, nkv = m.heads // tp, m.kv_heads_per_rank(tp)
    f = m.ffn // tp
    norm = (lambda: nn.LayerNorm(h)) if m.family == "gpt" else (lambda: nn.RMSNorm(h))
    p_drop = 0.1 if m.dropout else 0.0

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = norm(), norm()
            self.qkv = nn.Linear(h, (nq + 2 * nkv) * d, bias=m.biases)
            self.proj = nn.Linear(nq * d, h, bias=m.biases)
            self.up = nn.Linear(h, f * (2 if m.gated else 1), bias=m.biases)
            self.down = nn.Linear(f, h, bias=m.biases)
            self.drop = nn.Dropout(p_drop)

        def attention(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).split([nq * d, nkv * d, nkv * d], dim=-1)
            q = q.view(b, s, nq, d).transpose(1, 2)
            k = k.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
            v = v.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
            if m.flash_attention:
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
                probs = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
                o = probs @ v
            return self.proj(o.transpose(1, 2).reshape(b, s, nq * d))

        def mlp(self, x):
            y = self.up(x)
            if m.gated:
                g, u = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(g) * u
            else:
                y = torch.nn.functional.gelu(y, approximate="tanh")
            return self.down(y)

        def forward(self, x):
            x = x + self.drop(self.attention(self.norm1(x)))
            return x + self.drop(self.mlp(self.norm2(x)))

    return Layer().to(device=device, dtype=dtype)


def measure(layer, mbs: int, m: TransformerShape, device, dtype, warmup: int = 3, repeats: int = 10) -> dict:
    """Median forward and backward seconds of ``layer`` on a (mbs, seq, hidden) input, and the bytes
    of the tensors autograd saves (activations, parameters excluded)."""
    import torch

    cuda = device.type == "cuda"
    x = torch.randn(mbs, m.seq_len, m.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def clock():
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    fwd, bwd = [], []
    for i in range(warmup + repeats):
        t0 = clock()
        y = layer(x)
        t1 = clock()
        y.backward(grad)
        t2 = clock()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    act = float(sum(seen.values()))
    peak = None
    if cuda:
        del y
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        y = layer(x)
        y.backward(grad)
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    return {"mbs": mbs, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd), "act_bytes": act,
            "peak_bytes": peak}


def run_profile(m: TransformerShape, tps: list[int], sizes: list[int], device: str = "auto", gpu: str | None = None,
                warmup: int = 3, repeats: int = 10, log=print) -> dict:
    """Profile every (tp, mbs) and return the profile file's content (see measured.py)."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    cuda = dev.type == "cuda"
    dtype = getattr(torch, m.dtype) if cuda else torch.float32
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        device_name, detected = props.name, planner_gpu_name(props.name, props.total_memory)
    else:
        device_name, detected = platform.processor() or platform.machine() or "cpu", "cpu"
    torch.manual_seed(0)
    entries = []
    for tp in tps:
        layer = build_layer(m, tp, dev, dtype)
        for b in sizes:
            e = {"tp": tp, **measure(layer, b, m, dev, dtype, warmup, repeats)}
            entries.append(e)
            log(f"tp={tp} mbs={b}: forward {e['fwd_s'] * 1e3:.3f} ms, backward {e['bwd_s'] * 1e3:.3f} ms, "
                f"saved activations {e['act_bytes'] / 2**20:.1f} MiB")
        del layer
        if cuda:
            torch.cuda.empty_cache()
    return {"format": FORMAT, "gpu": (gpu or detected).lower(), "device_name": device_name,
            "dtype": str(dtype).replace("torch.", ""), "model": {"name": m.name, **model_shape(m)},
            "torch": torch.__version__, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "warmup": warmup, "repeats": repeats, "entries": entries}
