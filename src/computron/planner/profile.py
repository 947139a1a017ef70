"""``plan profile``: time one Transformer layer's forward and backward on the local device.

What flows through: a TransformerShape, TP degrees and micro-batch sizes go in; a profile dict (the
file format measured.py reads) comes out, one entry per (tp, mbs) with the median forward and
backward seconds of one layer shard (and ``step_s``, the two back to back as a step issues them, and
on CUDA ``graph_s``, the two replayed as one CUDA graph) and the bytes it saves for backward, and
(runtime layers, tp=1) one ``"part": "head"`` entry per mbs for the last stage's norm, logits and loss, and one
``"part": "recompute"`` entry per (tp, mbs) for the layer under activation checkpointing.

The layer is the one this project's training runtime runs (``computron.models``' decoder layer,
bf16 weights, fused attention) as ``computron train`` runs it: its backward includes adding the bf16
gradients into float32 accumulators, as the trainer does after every micro-batch. A shape the runtime
cannot run (dropout, unfused attention: Megatron-style GPT-3 configurations) is measured on a
self-contained torch.nn block instead (``build_layer``). Both are sharded the way Megatron shards
over ``tp`` ranks (heads/tp query heads, K/V heads per rank, FFN/tp), with no communication (the
planner adds TP all-reduces from its own model). This is the only planner module that imports
torch, and only inside its functions.
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


def _runtime_config(m: TransformerShape, tp: int, layers: int):
    """The runtime's ``ModelConfig`` of ``layers`` layers of one TP shard of ``m``, or None when the
    runtime cannot run the shape (dropout, or attention that is not fused). Its layer is the one
    ``computron train`` runs for the model ``m`` stands for (``train.accuracy.shape_of``): norm,
    positions, gating and biases by family, the activation and norm placement from ``m``."""
    if m.dropout or not m.flash_attention:
        return None
    from ..models.config import ModelConfig

    llama = m.family == "llama"
    return ModelConfig(m.name, "llama" if llama else "gpt2", m.vocab, m.hidden, layers, m.heads // tp, m.ffn // tp,
                       m.seq_len, num_kv_heads=m.kv_heads_per_rank(tp), head_size=m.head_dim,
                       norm="rmsnorm" if llama else "layernorm", position="rope" if llama else "learned",
                       activation=m.activation, gated_mlp=m.gated, attn_bias=m.biases, mlp_bias=m.biases,
                       norm_bias=m.biases, pre_norm=m.pre_norm, tie_embeddings=m.tie_embeddings, dtype="bfloat16")


def _bind_random(module, cfg, device, dtype) -> None:
    """Trainable random weights for ``module``'s parameters, initialised as a preset's are."""
    import torch

    from ..models.transformer import bind_weights, init_std

    weights = {}
    for n, p in module.named_parameters():
        std = init_std(n, cfg)
        weights[n] = (torch.ones(p.shape) if std is None else torch.randn(p.shape) * std).to(device, dtype)
    bind_weights(module, weights)
    for p in module.parameters():
        p.requires_grad_(True)


def runtime_layer(m: TransformerShape, tp: int, device, dtype):
    """The training runtime's decoder layer for one TP shard of ``m`` taking ``[mbs, seq, hidden]``,
    or None when the runtime cannot run the shape (dropout, or attention that is not fused)."""
    cfg = _runtime_config(m, tp, 1)
    if cfg is None:
        return None
    import torch
    from torch import nn

    from ..models.transformer import DecoderLayer, DenseBatch, rope_tables

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.rope = DecoderLayer(cfg, 0), {}
            _bind_random(self.layer, cfg, device, dtype)

        def forward(self, x):
            b, s, h = x.shape
            batch = DenseBatch(b)
            if cfg.position == "rope":  # the trainer computes these once per micro-batch, not per layer
                if (b, s) not in self.rope:
                    self.rope[b, s] = rope_tables(cfg, torch.arange(s, device=x.device).repeat(b), x.dtype)
                batch.rope = self.rope[b, s]
            return self.layer(x.reshape(b * s, h), batch).view(b, s, h)

    return Layer()


def runtime_head(m: TransformerShape, device, dtype):
    """The training runtime's last-stage head at tp=1 (final norm, logits over the vocabulary padded
    as the trainer pads it, the trainer's summed cross-entropy) as a module taking hidden states
    ``[N, hidden]`` and targets ``[N]`` to the loss, or None when the runtime cannot run the shape."""
    cfg = _runtime_config(m, 1, 0)
    if cfg is None:
        return None
    from torch import nn

    from ..models.transformer import DecoderLM
    from ..train.job import HEAD_ALIGN, SoftmaxCrossEntropy

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = DecoderLM(cfg, first=False, last=True)
            _bind_random(self.lm, cfg, device, dtype)

        def forward(self, x, targets):
            return SoftmaxCrossEntropy.apply(self.lm.head(x, HEAD_ALIGN, trim=False), targets, cfg.vocab_size)

    return Head()


def measure_head(head, mbs: int, m: TransformerShape, device, dtype, warmup: int = 3, repeats: int = 10) -> dict:
    """Median forward and backward seconds of ``head`` (``runtime_head``) on ``mbs`` sequences, its
    parameters' gradients added into float32 accumulators in the backward, as the trainer does."""
    import torch

    n = mbs * m.seq_len
    x = torch.randn(n, m.hidden, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, m.vocab, (n,), device=device)
    weights = list(head.parameters())
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in weights]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        loss = head(x, targets)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        for a, p in zip(acc, weights):
            a.add_(p.grad)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        x.grad = None
        for p in weights:
            p.grad = None
    return {"part": "head", "mbs": mbs, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd)}


def build_layer(m: TransformerShape, tp: int, device, dtype):
    """One decoder layer's TP shard as a torch.nn.Module (causal self-attention and the MLP with
    ``m``'s activation, norms before or after the residual adds as ``m.pre_norm`` says)."""
    import torch
    from torch import nn

    h, d = m.hidden, m.head_dim
    nq, nkv = m.heads // tp, m.kv_heads_per_rank(tp)
    f = m.ffn // tp
    norm = (lambda: nn.LayerNorm(h)) if m.family == "gpt" else (lambda: nn.RMSNorm(h))
    F = torch.nn.functional
    act = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda y: F.gelu(y, approximate="tanh"), "silu": F.silu}[m.activation]
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
                y = act(g) * u
            else:
                y = act(y)
            return self.down(y)

        def forward(self, x):
            if not m.pre_norm:
                x = self.norm1(x + self.drop(self.attention(x)))
                return self.norm2(x + self.drop(self.mlp(x)))
            x = x + self.drop(self.attention(self.norm1(x)))
            return x + self.drop(self.mlp(self.norm2(x)))

    return Layer().to(device=device, dtype=dtype)


def chain_depth(layer) -> int:
    """How many copies of ``layer`` :func:`measure` chains by default: 8, fewer for layers of over
    256 MiB of weights."""
    size = sum(p.numel() * p.element_size() for p in layer.parameters())
    return 8 if size <= 2**28 else 4 if size <= 2**30 else 2 if size <= 4 * 2**30 else 1


def measure(layer, mbs: int, m: TransformerShape, device, dtype, warmup: int = 3, repeats: int = 10,
            accumulate: bool = False, depth: int | None = None, recompute: bool = False, step: bool = True) -> dict:
    """Median forward and backward seconds of ``layer`` on a (mbs, seq, hidden) input, and the bytes
    of the tensors autograd saves (activations, parameters excluded). ``depth`` copies of the layer
    run in a chain, timed as a whole and divided by ``depth``: as in a model, the host queues a
    layer's kernels while the GPU runs the previous one (one layer between two synchronisations
    measures the host's launch time and the GPU's time added up, which small layers are dominated
    by). Default: :func:`chain_depth`. ``step_s``: the forward and the backward of the chain
    again, back to back without a synchronisation between them (one clock read before the forward,
    one after the backward), so that the host runs ahead of the device as in a training step: a
    layer's forward plus backward as a step issues them, where ``fwd_s + bwd_s`` adds the host's and
    the device's time of each half separately (``Assumptions.paired_steps``); ``step=False``: not
    timed (None; ``train/tpcoll.py``, which needs only the separate times). ``accumulate``: the backward
    also adds each parameter's gradient into a float32 accumulator (the trainer's micro-batch loop).
    ``recompute``: each layer runs under activation checkpointing, wrapped by the trainer's own
    ``train.job.recomputed`` (the same checkpoint call and options as ``computron train
    --recompute``). ``graph_s`` (on CUDA; else None): the chain's forward and backward
    captured as one CUDA graph (``computron train --cuda-graphs``, which replays each micro-batch so)
    and the replay timed: the device's time alone, no host launch in it."""
    import copy

    import torch

    cuda = device.type == "cuda"
    depth = chain_depth(layer) if depth is None else depth
    layers = [layer] + [copy.deepcopy(layer) for _ in range(depth - 1)]
    x = torch.randn(mbs, m.seq_len, m.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    weights = [p for one in layers for p in one.parameters()]
    params = {p.untyped_storage().data_ptr() for p in weights}
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in weights] if accumulate else []

    def clock():
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    chain = chained(layers, recompute)

    def backward(y):
        y.backward(grad)
        for a, p in zip(acc, weights):
            a.add_(p.grad)

    def clear():
        x.grad = None
        for p in weights:
            p.grad = None

    fwd, bwd, steps = [], [], []
    for i in range(warmup + repeats):
        t0 = clock()
        y = chain(x)
        t1 = clock()
        backward(y)
        t2 = clock()
        clear()
        if step:
            t3 = clock()
            backward(chain(x))  # the same work with no synchronisation between the forward and the backward
            t4 = clock()
            clear()
            if i >= warmup:
                steps.append((t4 - t3) / depth)
        if i >= warmup:
            fwd.append((t1 - t0) / depth)
            bwd.append((t2 - t1) / depth)
    graph_s = None
    if cuda:
        # on copies of the chain: the eager backward above left gradient accumulators of the weights
        # and of x made on the default stream, on which a capture must not depend (CUDA refuses it)
        chain_g, copies = fresh_chain(layers, recompute)
        xg = x.detach().clone().requires_grad_(True)
        graph_s = replayed(chain_g, xg, grad, [p for one in copies for p in one.parameters()],
                           [torch.zeros_like(a) for a in acc], device, warmup, repeats) / depth
        del chain_g, copies, xg
    seen: dict[int, int] = {}

    kept: list = []  # the saved tensors, alive until counted (a freed one's address is reused)

    def pack(t):  # the graph keeps nothing: a saved output held by its own graph is a cycle gc cannot see
        kept.append(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):  # this graph is never run backward
        y = chain(x)
    for t in kept:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
    del kept
    act = float(sum(seen.values())) / depth
    peak = None
    if cuda:
        del y
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        y = layer(x)
        y.backward(grad)
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    return {"mbs": mbs, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd),
            "step_s": statistics.median(steps) if step else None, "graph_s": graph_s, "act_bytes": act,
            "peak_bytes": peak}


def chained(layers, recompute: bool = False):
    """A function running ``layers`` one after the other, each checkpointed exactly as the trainer's
    ``recompute`` wraps its layers when ``recompute``."""
    if recompute:
        from ..train.job import recomputed

        layers = [recomputed(one) for one in layers]

    def chain(y):
        for one in layers:
            y = one(y)
        return y

    return chain


def fresh_chain(layers, recompute: bool = False):
    """(chain, copies): :func:`chained` over copies of ``layers``, and the copies, whose parameters
    no backward has touched yet."""
    import copy

    copies = [copy.deepcopy(one) for one in layers]
    return chained(copies, recompute), copies


_SIDE: dict = {}


def side_stream(device):
    """One side stream per device for the eager runs before a capture, kept: the matrix library
    allocates a workspace for every stream it runs on and keeps it while the process lives."""
    import torch

    key = torch.device(device)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(key)
    return _SIDE[key]


def replayed(chain, x, grad, weights, acc, device, warmup: int, repeats: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``chain``'s forward on ``x`` and its backward
    from ``grad`` (to ``x`` and ``weights``, added into the float32 ``acc`` where given), captured as
    the trainer captures a micro-batch (``train/job.py``): eager runs on a side stream first, so that
    libraries allocate their workspaces outside the capture."""
    import torch

    def work():
        got = torch.autograd.grad(chain(x), [x, *weights], grad)
        if acc:
            torch._foreach_add_(acc, list(got[1:]))

    here, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(here)
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
    here.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        work()
    times = []
    for i in range(warmup + repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    graph.reset()
    return statistics.median(times)


def _graphed(e: dict) -> str:
    return "" if e.get("graph_s") is None else f", as a CUDA graph {e['graph_s'] * 1e3:.3f} ms"


def run_profile(m: TransformerShape, tps: list[int], sizes: list[int], device: str = "auto", gpu: str | None = None,
                warmup: int = 3, repeats: int = 10, log=print, recompute: bool = True) -> dict:
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
    entries, kind = [], "runtime"
    for tp in tps:
        layer = runtime_layer(m, tp, dev, dtype)
        if layer is None:
            layer, kind = build_layer(m, tp, dev, dtype), "reference"
        for b in sizes:
            e = {"tp": tp, **measure(layer, b, m, dev, dtype, warmup, repeats, accumulate=kind == "runtime")}
            entries.append(e)
            log(f"tp={tp} mbs={b}: forward {e['fwd_s'] * 1e3:.3f} ms, backward {e['bwd_s'] * 1e3:.3f} ms, "
                f"both as a step {e['step_s'] * 1e3:.3f} ms{_graphed(e)}, "
                f"saved activations {e['act_bytes'] / 2**20:.1f} MiB")
            if kind == "runtime" and recompute:
                r = measure(layer, b, m, dev, dtype, warmup, repeats, accumulate=True, recompute=True)
                entries.append({"tp": tp, "part": "recompute", "mbs": b, "fwd_s": r["fwd_s"], "bwd_s": r["bwd_s"],
                                "step_s": r["step_s"], "graph_s": r["graph_s"]})
                log(f"tp={tp} mbs={b}: recomputed layer forward {r['fwd_s'] * 1e3:.3f} ms, "
                    f"backward {r['bwd_s'] * 1e3:.3f} ms, both as a step {r['step_s'] * 1e3:.3f} ms{_graphed(r)}")
        del layer
        head = runtime_head(m, dev, dtype) if tp == 1 else None  # tp > 1: the roofline's head (logits gathered)
        for b in sizes if head is not None else ():
            e = {"tp": tp, **measure_head(head, b, m, dev, dtype, warmup, repeats)}
            entries.append(e)
            log(f"tp={tp} mbs={b}: head and loss forward {e['fwd_s'] * 1e3:.3f} ms, backward {e['bwd_s'] * 1e3:.3f} ms")
        del head
        if cuda:
            torch.cuda.empty_cache()
    return {"format": FORMAT, "gpu": (gpu or detected).lower(), "device_name": device_name,
            "dtype": str(dtype).replace("torch.", ""), "model": {"name": m.name, **model_shape(m)}, "layer": kind,
            "torch": torch.__version__, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "warmup": warmup, "repeats": repeats, "entries": entries}
