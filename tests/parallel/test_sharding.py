"""Tensor and pipeline sharding on the CPU: every layout's logits equal tp=1's, over real gloo groups.

Each parallel case runs one process per rank (``torch.multiprocessing`` spawn, gloo on a free
loopback port); every rank builds only its shard, runs a batched prefill of sequences of
different lengths and a few greedy decode steps over its own paged KV cache, and the last rank
writes its logits and tokens to a file the test compares with the plain tp=1 model's.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from computron.memory.host import HostImage
from computron.memory.layout import WeightLayout
from computron.models import checkpoint as ckpt
from computron.models.kvcache import KVPool, block_bytes, paged_batch
from computron.models.presets import get_preset
from computron.models.transformer import DecoderLM, bind_weights
from computron.parallel.dims import ParallelDims
from computron.parallel.sharding import Cut, cut_tensor, head_slices, shard_for, stage_layers, vocab_range

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 49)), [300 % 256, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
DECODE_STEPS = 4
BLOCK_TOKENS = 8
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


# ---------------------------------------------------------------------------------- pure slicing


def test_stage_layers_uniform_given_and_invalid():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(6, 2, [1, 5]) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="needs 2 stage sizes, got 3"):
        stage_layers(6, 2, [2, 2, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layers(6, 2, [6, 0])
    with pytest.raises(ValueError, match=r"covers 5 layers, the model has 6"):
        stage_layers(6, 2, [2, 3])
    with pytest.raises(ValueError, match="pp=3 exceeds the 2 layers"):
        stage_layers(2, 3)


def test_gqa_heads_for_tp2_and_tp4_on_two_kv_heads():
    assert head_slices(4, 2, 2, 0) == (range(0, 2), range(0, 1))
    assert head_slices(4, 2, 2, 1) == (range(2, 4), range(1, 2))
    # tp > kv heads: each rank keeps the key/value head its query head reads
    assert [head_slices(4, 2, 4, r) for r in range(4)] == [
        (range(0, 1), range(0, 1)), (range(1, 2), range(0, 1)), (range(2, 3), range(1, 2)), (range(3, 4), range(1, 2))]
    with pytest.raises(ValueError, match="tp=3 cannot split"):
        head_slices(4, 2, 3, 0)


def test_vocab_ranges_are_contiguous_and_padded():
    assert [vocab_range(301, 2, r) for r in range(2)] == [(0, 151, 151), (151, 301, 151)]
    assert [vocab_range(512, 4, r) for r in range(4)] == [(i * 128, (i + 1) * 128, 128) for i in range(4)]
    t = torch.arange(301.0)[:, None].expand(301, 3)
    last = cut_tensor(t, Cut(0, ((151, 301),), 151))
    assert last.shape == (151, 3) and last[-1].eq(0).all() and last[0, 0] == 151


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_shard_shapes_and_cuts_cover_the_full_tensors(tp):
    cfg = get_preset("tiny-llama")  # 4 query heads, 2 kv heads, head_dim 16, ffn 172, vocab 512
    full = {n: tuple(p.shape) for n, p in DecoderLM(cfg).named_parameters()}
    shards = [shard_for(cfg, ParallelDims(tp=tp), r) for r in range(tp)]
    local = shards[0].config
    assert (local.num_heads, local.kv_heads, local.head_dim, local.ffn_size) == (4 // tp, 1, 16, 172 // tp)
    shapes = {n: tuple(p.shape) for n, p in DecoderLM(local).named_parameters()}
    assert shapes["layers.0.attn.qkv_weight"] == ((4 // tp + 2) * 16, 64)
    assert shapes["layers.0.mlp.up_weight"] == (2 * 172 // tp, 64)
    assert shapes["layers.0.mlp.down_weight"] == (64, 172 // tp)
    assert shapes["embed_tokens"] == shapes["lm_head"] == (512 // tp, 64)
    for name, shape in shapes.items():
        assert shards[0].cut(name, full[name]).shape(full[name]) == shape, name
    # cutting a full tensor of distinct values gives each rank exactly its heads (q, then k, then v)
    qkv = torch.arange(float(full["layers.0.attn.qkv_weight"][0]))[:, None]
    got = [cut_tensor(qkv, s.cut("layers.0.attn.qkv_weight", (qkv.shape[0], 1)))[:, 0].long() // 16 for s in shards]
    q = [h // 16 for h in range(0, 64, 16)]
    for r, g in enumerate(got):
        kv = shards[r].kv_heads.start
        assert g.unique_consecutive().tolist() == [*q[r * 4 // tp:(r + 1) * 4 // tp], 4 + kv, 6 + kv]
    up = torch.arange(344.0)[:, None]
    halves = [cut_tensor(up, s.cut("layers.0.mlp.up_weight", (344, 1)))[:, 0] for s in shards]
    assert torch.cat([h[: 172 // tp] for h in halves]).equal(up[:172, 0])  # gate halves, in rank order
    assert torch.cat([h[172 // tp:] for h in halves]).equal(up[172:, 0])  # up halves


def test_row_parallel_bias_on_tensor_rank_zero_only_and_bad_layouts():
    cfg = get_preset("tiny-opt")
    s0, s1 = (shard_for(cfg, ParallelDims(tp=2), r) for r in range(2))
    assert not s0.cut("layers.0.attn.o_bias", (64,)).zero and s1.cut("layers.0.mlp.down_bias", (64,)).zero
    assert s1.cut("layers.0.attn.qkv_bias", (192,)).shape((192,)) == (96,)
    assert s1.cut("layers.1.attn_norm.weight", (64,)) == Cut(0, ((0, 64),), 64)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        shard_for(cfg, ParallelDims(tp=3), 0)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        shard_for(cfg, ParallelDims(tp=2, pp=2), 4)
    with pytest.raises(ValueError, match="does not divide the MLP width 100"):
        shard_for(cfg.with_(ffn_size=100, num_heads=8), ParallelDims(tp=8), 0)


def test_tp1_shard_image_equals_the_plain_preset_image():
    from computron.parallel.shard_model import build_rank

    cfg = get_preset("tiny-llama")
    _, _, image = build_rank(cfg, ParallelDims(), 0, seed=3)
    plain = HostImage(WeightLayout.of(DecoderLM(cfg), torch.float32), pin=False)
    plain.fill_random(cfg, 3)
    assert image.layout == plain.layout
    for name, view in plain.views.items():  # the bytes between aligned entries are uninitialised
        assert image.views[name].equal(view), name


def test_pipeline_stage_holds_only_its_layers_and_ends():
    from computron.parallel.shard_model import shard_model

    cfg = get_preset("tiny-gpt2")  # tied embeddings: the last stage keeps embed_tokens as its head
    first, last = (shard_model(shard_for(cfg, ParallelDims(tp=2, pp=2), r)) for r in (0, 3))
    assert set(dict(first.named_parameters())) >= {"embed_tokens", "embed_positions"}
    assert "final_norm.weight" not in dict(first.named_parameters()) and len(first.layers) == 1
    names = set(dict(last.named_parameters()))
    assert "embed_positions" not in names and {"embed_tokens", "final_norm.weight"} <= names


# ---------------------------------------------------------------------------------- end to end


def _run(cfg, dims: ParallelDims, rank: int, checkpoint=None, seed: int = 0):
    """Prefill PROMPTS as one batch, then DECODE_STEPS greedy steps; (logits per step, tokens) on
    the last stage, None elsewhere. With world size 1 and no checkpoint sharding the plain model runs."""
    import torch.distributed as dist

    from computron.engine.runner import ModelRunner
    from computron.parallel.collectives import StageLinks, install_tp_hooks, tp_group
    from computron.parallel.shard_model import build_rank

    world = dims.world_size
    if world == 1:  # the reference: the plain model, loaded by the existing (unsharded) paths
        model = DecoderLM(cfg)
        image = HostImage(WeightLayout.of(model, torch.float32), pin=False)
        ckpt.load_weights(checkpoint, cfg, image.views) if checkpoint else image.fill_random(cfg, seed)
        bind_weights(model, image.views)
        local, last = cfg, True

        def forward(ids, pos, batch):
            with torch.inference_mode():
                return model(ids, pos, batch).index_select(0, batch.last)
    else:
        shard, model, _ = build_rank(cfg, dims, rank, seed=seed, checkpoint=checkpoint)
        install_tp_hooks(model, shard, tp_group(dims, rank))
        forward = ModelRunner(shard.config, model, StageLinks(shard)).forward
        local, last = shard.config, shard.last
    per_seq = -(-(max(map(len, PROMPTS)) + DECODE_STEPS) // BLOCK_TOKENS)
    bb = block_bytes(local, BLOCK_TOKENS)
    pool = KVPool(torch.zeros(bb * per_seq * len(PROMPTS), dtype=torch.uint8), local, BLOCK_TOKENS, bb)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    seqs = [(blocks[i], 0, len(p)) for i, p in enumerate(PROMPTS)]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    cached = [len(p) for p in PROMPTS]
    all_logits, all_tokens = [], []
    for step in range(DECODE_STEPS + 1):
        logits = forward(ids, pos, paged_batch(pool, seqs, torch.device("cpu")))
        tokens = logits.argmax(-1) if last else torch.zeros(len(PROMPTS), dtype=torch.int64)
        if world > 1:
            dist.broadcast(tokens, src=world - 1)
        if last:
            all_logits.append(logits.clone())
            all_tokens.append(tokens.tolist())
        seqs = [(blocks[i], cached[i], 1) for i in range(len(PROMPTS))]
        ids, pos = tokens, torch.tensor(cached)
        cached = [c + 1 for c in cached]
    return (all_logits, all_tokens) if last else None


class _CountingSlice:
    def __init__(self, sl, stats):
        self.sl, self.stats = sl, stats

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        t = self.sl[index]
        self.stats["read"] += t.numel()
        return t


class _CountingFile:
    """A safe_open handle that counts the elements its slices return and every whole-tensor read."""

    def __init__(self, handle, stats):
        self.h, self.stats = handle, stats

    def __enter__(self):
        self.h.__enter__()
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, name):
        self.stats["whole"] += 1
        return self.h.get_tensor(name)

    def get_slice(self, name):
        return _CountingSlice(self.h.get_slice(name), self.stats)


def _worker(rank, world, port, jobs, tp, pp, out_dir):
    """Run each job ``(key, cfg, checkpoint or None)`` in turn over one gloo group (one import, one init)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    opener, results = ckpt._open, {}
    try:
        for key, cfg, checkpoint in jobs:
            stats = {"read": 0, "whole": 0}
            ckpt._open = lambda file, stats=stats: _CountingFile(opener(file), stats)
            out = _run(cfg, ParallelDims(tp=tp, pp=pp), rank, checkpoint)
            results[key] = {"out": out, **stats}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ckpt._open = opener
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(jobs, tp, pp, tmp_path) -> list[dict]:
    """Each rank's results by job key, from one process per rank."""
    import torch.multiprocessing as mp

    world = tp * pp
    mp.spawn(_worker, args=(world, _free_port(), jobs, tp, pp, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_same(got, ref):
    (logits, tokens), (ref_logits, ref_tokens) = got, ref
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


MODELS = ["tiny-opt", "tiny-gpt2", "tiny-llama"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_logits_equal_tp1(layout, tmp_path):
    tp, pp = LAYOUTS[layout]
    results = _spawn([(m, get_preset(m), None) for m in MODELS], tp, pp, tmp_path)
    for model in MODELS:
        ref = _run(get_preset(model), ParallelDims(), 0)
        for r in range(tp * pp):  # every rank of the last stage returns the full logits; the others none
            out = results[r][model]["out"]
            assert (out is not None) == (r // tp == pp - 1), (model, r)
            if out is not None:
                _assert_same(out, ref)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory, hf_saver):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=301)  # odd: the last vocabulary range is padded
    configs = {
        "opt": transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                      max_position_embeddings=128, word_embed_proj_dim=32, **common),
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common),
        "llama": transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                          **common),
    }
    return {name: path for name, (path, _) in hf_saver(tmp_path_factory, configs).items()}


def test_checkpoint_loaded_shard_by_shard_reads_only_its_slices(hf_checkpoints, tmp_path):
    from computron.parallel.shard_model import shard_model

    tp, pp = 2, 2
    cfgs = {f: ckpt.read_config(p, "float32") for f, p in hf_checkpoints.items()}
    results = _spawn([(f, cfgs[f], str(p)) for f, p in hf_checkpoints.items()], tp, pp, tmp_path)
    for family, cfg in cfgs.items():
        ref = _run(cfg, ParallelDims(), 0, checkpoint=str(hf_checkpoints[family]))
        full = ckpt.expected_shapes(cfg)
        total = sum(torch.Size(s).numel() for s in full.values())
        read = []
        for r in range(tp * pp):
            res, shard = results[r][family], shard_for(cfg, ParallelDims(tp=tp, pp=pp), r)
            expected = sum(shard.cut(n, full[shard.global_name(n)]).numel_read(full[shard.global_name(n)])
                           for n, _ in shard_model(shard).named_parameters())
            assert res["whole"] == 0 and res["read"] == expected, (family, r)
            read.append(res["read"])
            if res["out"] is not None:
                _assert_same(res["out"], ref)
        # four ranks together read about one model (replicated norms, row-parallel biases on rank 0 only;
        # the last stage of a tied model reads its vocabulary range again as its head), none half of it
        assert sum(read) < 1.6 * total and max(read) < 0.5 * total, (family, read, total)
