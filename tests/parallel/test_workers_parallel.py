"""Model-parallel serving on the CPU: two worker processes joined by gloo stand for two GPUs.
Models sharded with tp=2 and pp=2 beside an unsharded one on the second device give the tokens
of a single-device engine, through swaps."""

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_k=40, seed=11, ignore_eos=True)
PROMPTS = ["hello", "the quick brown fox", "swap me in", "1 2 3", "Ünïcödé ✓", "abc"]


def test_sharded_models_on_two_workers_match_one_device_through_swaps():
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
    for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"):
        ref.register_model(m)
    # Device 1 holds half of tiny-opt, the second stage of tiny-llama and all of tiny-gpt2 (~1.2 MB):
    # more than its 878 KiB arena, so requests swap there.
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=950_000,
                              workspace_bytes=50_000))
    try:
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        eng.register_model(ModelSpec("tiny-llama", pp=2))
        eng.register_model(ModelSpec("tiny-gpt2", devices=[1]))
        info = eng.models["tiny-opt"].info
        assert info.placement.devices == (0, 1) and len(info.weight_bytes) == 2
        assert info.weight_bytes[0] < ref.models["tiny-opt"].nbytes * 0.7  # each rank holds about half
        assert eng.model_stats("tiny-llama")["parallel"] == {"dp": 1, "tp": 1, "pp": 2}
        jobs = [(m, p, sp) for i, p in enumerate(PROMPTS)
                for m, sp in [(("tiny-opt", "tiny-llama", "tiny-gpt2")[i % 3], GREEDY),
                              (("tiny-gpt2", "tiny-opt", "tiny-llama")[i % 3], SEEDED)]]
        want = [ref.generate(m, p, sp).output_ids for m, p, sp in jobs]
        reqs = [eng.submit(m, p, sp) for m, p, sp in jobs]  # interleaved across models and layouts
        eng.run_until_done(reqs)
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
        assert eng.stats["evictions"] >= 1 and eng.stats["swap_ins"] >= 3
        before = eng.stats["swap_ins"]
        for m, p, sp in jobs[:6]:  # one at a time, round robin: each needs memory another holds
            assert eng.generate(m, p, sp).output_ids == ref.generate(m, p, sp).output_ids
        assert eng.stats["swap_ins"] - before >= 4
        devices = eng.memory()["devices"]
        assert [d["device"] for d in devices] == ["cpu", "cpu"] and all(d["weights"] <= d["capacity"] for d in devices)
    finally:
        eng.executor.shutdown()
