"""``plan profile`` measures the training runtime's own layer where the runtime can run the shape."""

import pytest
import torch

from computron.models.presets import PRESETS, get_preset
from computron.models.transformer import DenseBatch, bind_weights, rope_tables
from computron.parallel.dims import ParallelDims
from computron.parallel.shard_model import build_rank
from computron.planner import costs
from computron.planner.model import TransformerShape
from computron.planner.profile import _runtime_config, measure, run_profile, runtime_layer
from computron.train.accuracy import shape_of

# what a decoder layer is made of (the embeddings and head aside); rope_theta and norm_eps change
# values, not a layer's work or what it keeps
LAYER_FIELDS = ("hidden_size", "num_heads", "kv_heads", "head_dim", "ffn_size", "norm", "position", "activation",
                "gated_mlp", "attn_bias", "mlp_bias", "norm_bias", "pre_norm")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_profiled_with_the_trainers_layer(name):
    """OPT's layer was profiled as the gpt family's GeLU layer; now each preset's own."""
    cfg = PRESETS[name]
    got = _runtime_config(shape_of(cfg, 128, 1), 1, 1)
    assert {f: getattr(got, f) for f in LAYER_FIELDS} == {f: getattr(cfg, f) for f in LAYER_FIELDS}


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-gpt2", "tiny-llama"])
def test_the_profiled_layer_computes_what_the_trainers_does(name):
    """The profile's layer, given the trainer's layer-0 weights, gives the trainer's output."""
    cfg = get_preset(name).with_(dtype="float32")
    _, model, _ = build_rank(cfg, ParallelDims(), 0)
    trainer = model.layers[0]
    layer = runtime_layer(shape_of(cfg, 16, 8), 1, torch.device("cpu"), torch.float32)
    bind_weights(layer.layer, {n: p.detach().clone() for n, p in trainer.named_parameters()})
    x = torch.randn(2, 16, cfg.hidden_size)
    batch = DenseBatch(2)
    if cfg.position == "rope":
        batch.rope = rope_tables(cfg, torch.arange(16).repeat(2), torch.float32)
    want = trainer(x.reshape(32, -1), batch).view_as(x)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-gpt2", "tiny-llama"])
def test_the_runtime_layer_is_the_trainers_shard_of_the_same_model(name):
    cfg = get_preset(name)  # tiny-llama: GQA, 4 query heads, 2 key/value heads
    shape = shape_of(cfg, 16, 8)
    for tp in (1, 2):
        _, model, _ = build_rank(cfg.with_(dtype="float32"), ParallelDims(tp=tp), 0)
        want = {n: p.shape for n, p in model.layers[0].named_parameters()}
        layer = runtime_layer(shape, tp, torch.device("cpu"), torch.float32)
        assert {n.removeprefix("layer."): p.shape for n, p in layer.named_parameters()} == want
        x = torch.randn(2, 16, cfg.hidden_size)
        assert layer(x).shape == x.shape and torch.isfinite(layer(x)).all()


def test_profile_records_which_layer_it_measured():
    llama = TransformerShape("l", "llama", 2, 64, 4, 172, 256, 16, 8, kv_heads=2, flash_attention=True)
    got = run_profile(llama, [1, 2], [1, 2], device="cpu", warmup=1, repeats=2, log=lambda s: None)
    layers = [e for e in got["entries"] if e.get("part", "layer") == "layer"]
    heads = [e for e in got["entries"] if e.get("part") == "head"]
    assert got["layer"] == "runtime" and len(layers) == 4
    assert all(e["fwd_s"] > 0 and e["bwd_s"] > 0 and e["act_bytes"] > 0 for e in layers)
    # the head and loss measured at tp=1, and the cost model takes them instead of the roofline
    assert [(e["tp"], e["mbs"]) for e in heads] == [(1, 1), (1, 2)] and all(e["bwd_s"] > 0 for e in heads)
    from computron.planner.estimate import CostModel
    from computron.planner.hardware import GPU_TYPES
    from computron.planner.measured import table_from_dict

    cm = CostModel(llama, profile=table_from_dict(got, gpu="a100-80gb"))
    gpu = GPU_TYPES["a100-80gb"]
    assert cm.head(gpu, 1, 2) == (heads[1]["fwd_s"], heads[1]["bwd_s"])
    assert cm.head(gpu, 2, 2) != cm.head(gpu, 1, 2)  # tp=2 not measured: the roofline
    # the layer recomputed as the trainer checkpoints it: what it adds to the backward is measured
    rec = {(e["tp"], e["mbs"]): e for e in got["entries"] if e.get("part") == "recompute"}
    assert sorted(rec) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    plain = {(e["tp"], e["mbs"]): e for e in layers}
    want = (max(rec[1, 2]["fwd_s"] - plain[1, 2]["fwd_s"], 0.0), max(rec[1, 2]["bwd_s"] - plain[1, 2]["bwd_s"], 0.0))
    assert cm.recomputed(gpu, 1, 2, 1, fwd=123.0) == want != (0.0, 123.0)
    assert cm.recomputed(gpu, 1, 2, 2, fwd=123.0) == (0.0, 123.0)  # cp > 1 was not measured: the forward again
    gpt = TransformerShape("g", "gpt", 2, 64, 4, 256, 256, 16, 8, dropout=True)  # the runtime has no dropout
    assert runtime_layer(gpt, 1, torch.device("cpu"), torch.float32) is None
    assert run_profile(gpt, [1], [1], device="cpu", warmup=1, repeats=2, log=lambda s: None)["layer"] == "reference"


def test_profiling_leaves_no_tensor_behind():
    """The activation count's graph once kept itself alive (a saved output held by its own graph):
    the memory of every profile then stayed allocated under the trainer measured next."""
    import gc

    def tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    before = tensors()
    llama = TransformerShape("l", "llama", 2, 64, 4, 172, 256, 16, 8, kv_heads=2, flash_attention=True)
    run_profile(llama, [1], [2], device="cpu", warmup=1, repeats=1, log=lambda s: None)
    assert tensors() == before


def test_saved_activations_are_counted_whole():
    """What one layer keeps for its backward, counted while every saved tensor is still alive: a
    GPT-style layer (LayerNorm, GeLU MLP, fused attention) keeps at least its four inputs of the
    matrix products, the two norm inputs and the MLP's up-projection output."""
    m = TransformerShape("g", "gpt", 2, 64, 4, 256, 256, 16, 8, flash_attention=True, dropout=False)
    got = run_profile(m, [1], [2], device="cpu", warmup=1, repeats=1, log=lambda s: None, recompute=False)
    (e,) = [e for e in got["entries"] if e.get("part", "layer") == "layer"]
    tokens = 2 * 16
    assert e["act_bytes"] >= 4 * tokens * (6 * m.hidden + 2 * m.ffn)


def test_relu_keeps_one_ffn_tensor_where_gelu_keeps_two():
    """OPT's ReLU keeps only its output (the down projection's input too); GeLU keeps its input as
    well: the bytes autograd saves differ by one ffn-sized tensor, as costs.activation_bytes says."""
    dev, b = torch.device("cpu"), 2
    got, want = {}, {}
    for act in ("relu", "gelu_new"):
        m = TransformerShape("g", "gpt", 2, 64, 4, 256, 256, 16, 8, flash_attention=True, dropout=False, activation=act)
        torch.manual_seed(0)
        got[act] = measure(runtime_layer(m, 1, dev, torch.float32), b, m, dev, torch.float32, 0, 1, depth=2)["act_bytes"]
        want[act] = costs.activation_bytes(m, 1, b)
    tokens = b * 16
    assert got["gelu_new"] - got["relu"] == 4 * tokens * 256  # float32 on the CPU
    assert want["gelu_new"] - want["relu"] == 2 * tokens * 256  # the shape's 16-bit elements
    # the whole count: the formula in float32 (twice its 16-bit bytes), to the attention's row statistics
    assert got["relu"] == pytest.approx(2 * want["relu"], rel=0.01)


def _saved_storages(layer, x) -> list[int]:
    """Elements of each distinct storage autograd saves in ``layer(x)``, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t), lambda _: None):
        layer(x)
    seen = {t.untyped_storage().data_ptr(): t for t in kept if t.untyped_storage().data_ptr() not in params}
    return sorted(t.untyped_storage().nbytes() // t.element_size() for t in seen.values())


@pytest.mark.parametrize("kv", [2, 4])  # tiny-llama's grouped K/V heads, and one per query head
@pytest.mark.parametrize("tp", [1, 2])
def test_unfused_llama_counts_what_the_trainers_layer_keeps(tp, kv):
    """The trainer's Llama layer (runtime_layer's shard), tensor by tensor: each norm's input, float32
    1/rms and output; the QKV output whole (V is a view of it), RoPE's rotated Q and K and its cos
    and sin tables; the fused attention's output and log-sum-exp; the up projection's output (the
    gate and up halves), the SiLU output and the product. On the CPU two more: the composite RMSNorm
    keeps x/rms for its weight's gradient (CUDA's fused kernel keeps only x and 1/rms), and the
    tables, which the trainer makes once per micro-batch for all the stage's layers, count whole
    for this one layer. The formula with ``unfused_llama`` is the rest to the byte: float32 here,
    so twice its 16-bit tensors and its float32 statistics as they are."""
    m = TransformerShape("l", "llama", 2, 64, 4, 172, 256, 16, 8, kv_heads=kv, flash_attention=True)
    dev, b, s = torch.device("cpu"), 2, 16
    M, h, d, f = b * s, m.hidden, m.head_dim, m.ffn // tp
    hq, hk = m.heads // tp, m.kv_heads_per_rank(tp)
    torch.manual_seed(0)
    layer = runtime_layer(m, tp, dev, torch.float32)
    norm = [M * h, M, M * h]  # input, 1/rms, output (the next product's input)
    attn = [M * (hq + 2 * hk) * d, M * (hq + hk) * d, M * d, M * d, M * hq * d, b * hq * s]
    mlp = [M * 2 * f, M * f, M * f]
    cpu = [M * h, M * h]  # the composite RMSNorm's x/rms
    want = sorted(norm + attn + norm + mlp + cpu)
    assert _saved_storages(layer, torch.randn(b, s, h, requires_grad=True)) == want
    got = measure(layer, b, m, dev, torch.float32, 0, 1, depth=1)["act_bytes"]
    assert got == 4 * sum(want)
    stats = 4 * (2 * M + b * hq * s)  # 1/rms and log-sum-exp: float32 on any device
    formula = costs.activation_bytes(m, tp, b, a=costs.Assumptions(unfused_llama=True))
    assert got == 2 * (formula - stats) + stats + 4 * (2 * M * d + sum(cpu))
    # Megatron's count, the default, leaves out the SiLU output, the unrotated Q and K and the 1/rms
    assert formula - costs.activation_bytes(m, tp, b) == 2 * M * (f + (hq + hk) * d) + 4 * 2 * M


def test_the_profile_checkpoints_its_layer_as_the_trainer_does(monkeypatch):
    """The ``recompute`` entry must time what ``computron train --recompute`` runs: each layer under
    the same checkpoint call with the same options (the trainer skips the RNG stash, which is host
    work per layer the profile once paid and the trainer did not)."""
    import torch.utils.checkpoint as tuc

    from computron.train.config import TrainConfig
    from computron.train.job import Trainer

    real, calls = tuc.checkpoint, []

    def spy(fn, *args, **kw):
        calls.append(kw)
        return real(fn, *args, **kw)

    monkeypatch.setattr(tuc, "checkpoint", spy)
    m = TransformerShape("g", "gpt", 2, 64, 4, 256, 256, 16, 8, flash_attention=True, dropout=False)
    layer = runtime_layer(m, 1, torch.device("cpu"), torch.float32)
    measure(layer, 1, m, torch.device("cpu"), torch.float32, warmup=0, repeats=1, depth=2, recompute=True)
    profiled, calls[:] = list(calls), []
    Trainer(TrainConfig(model="tiny-opt", seq_len=16, global_batch=8, micro_batch=8, steps=1, recompute=True,
                        synthetic_tokens=4096)).train_step()
    trained = list(calls)
    assert profiled and trained
    assert all(kw == trained[0] for kw in profiled + trained), (profiled, trained)
    assert trained[0] == {"use_reentrant": False, "preserve_rng_state": False}


def test_the_profile_times_forward_and_backward_as_a_step_too(tmp_path):
    """Every layer entry, plain and recomputed, also carries ``step_s`` (the forward and backward back
    to back, the host free to run ahead as in a step), and the file as written loads with it. Its
    size against ``fwd_s + bwd_s`` means something on a GPU only (a CPU has no host to run ahead)."""
    import json

    from computron.planner.measured import load_profile

    m = TransformerShape("l", "llama", 2, 64, 4, 172, 256, 16, 8, kv_heads=2, flash_attention=True)
    got = run_profile(m, [1], [1, 2], device="cpu", warmup=0, repeats=1, log=lambda s: None)
    layers = [e for e in got["entries"] if e.get("part", "layer") in ("layer", "recompute")]
    assert sorted((e.get("part", "layer"), e["mbs"]) for e in layers) == \
        [("layer", 1), ("layer", 2), ("recompute", 1), ("recompute", 2)]
    assert all(isinstance(e["step_s"], float) and e["step_s"] > 0 for e in layers)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(got))
    t = load_profile(str(path), "h200")
    for e in layers:
        assert t.lookup_step(e.get("part", "layer"), "h200", 1, e["mbs"]) == e["step_s"]
    assert t.lookup_step("layer", "h100", 1, 1) is None and t.lookup_step("layer", "h200", 2, 1) is None


@pytest.mark.parametrize("recompute", [False, True])
def test_the_graphed_timing_runs_a_fresh_copy_of_the_same_chain(recompute):
    """A CUDA graph must not meet the gradient accumulators the eager timing left on the default
    stream, so ``measure`` captures copies of its chain (``fresh_chain``): the same outputs and
    gradients, parameters of their own that no backward has touched; on the CPU no graph is timed."""
    from computron.planner.profile import fresh_chain

    m = TransformerShape("g", "gpt", 2, 64, 4, 256, 256, 16, 8, flash_attention=True, dropout=False)
    torch.manual_seed(0)
    layers = [runtime_layer(m, 1, torch.device("cpu"), torch.float32) for _ in range(2)]
    x = torch.randn(2, 16, 64, requires_grad=True)
    ref = x
    for one in layers:
        ref = one(ref)
    ref_grads = torch.autograd.grad(ref.sum(), [x, *[p for one in layers for p in one.parameters()]])
    chain, copies = fresh_chain(layers, recompute)
    weights = [p for one in copies for p in one.parameters()]
    assert all(p.grad is None for p in weights)
    assert not {id(p) for p in weights} & {id(p) for one in layers for p in one.parameters()}
    xc = x.detach().clone().requires_grad_(True)
    out = chain(xc)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out.sum(), [xc, *weights]), ref_grads):
        torch.testing.assert_close(got, want)
    e = measure(layers[0], 1, m, torch.device("cpu"), torch.float32, warmup=0, repeats=1, depth=2, recompute=recompute)
    assert e["graph_s"] is None
