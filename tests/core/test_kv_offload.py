"""KV blocks of stopped requests moved to host memory and back (``kv_host_bytes``): the scheduler's
accounting under random steps (device budget and host budget never exceeded, no request lost), the
slo policy's choice, and through the real engine on the CPU the same tokens as undisturbed runs."""

import random

import pytest

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams
from computron.memory.units import kv_region_bytes
from computron.scheduler import ModelCost, SchedRequest, Scheduler, SchedulerConfig, Slo

KVT = 512
BLOCK = kv_region_bytes(4, KVT)


def _check(s: Scheduler, budget: int, host: int) -> None:
    """What the scheduler books equals what its requests hold: device blocks of running and paused
    requests plus resident weights within the budget; offloaded requests' bytes within the host budget."""
    dev = host_used = 0
    for m in s.models.values():
        for r in (*m.running.values(), *m.paused.values()):
            if r.state == "offloaded":
                assert not m.on_device
                host_used += r.blocks * sum(m.block_bytes)
            else:
                dev += r.blocks * m.block_bytes[0]
    weights = sum(m.weights[0] for m in s.models.values() if m.on_device)
    assert s.kv_used[0] == dev and weights + dev <= budget and s.free_bytes(0) == budget - weights - dev
    assert s.host_used == host_used <= host


@pytest.mark.parametrize("policy", ["preempt-keep-kv", "slo"])
@pytest.mark.parametrize("seed", range(4))
def test_random_steps_keep_device_and_host_budgets(policy, seed):
    rng = random.Random(seed)
    budget, host = 400_000, rng.choice([3, 10, 40]) * BLOCK
    cost = ModelCost(load_s=0.05, prefill_fixed_s=0.01, prefill_token_s=0.002, decode_fixed_s=0.01, decode_seq_s=0.0)
    s = Scheduler(SchedulerConfig(budgets=budget, policy=policy.split("-")[0], block_tokens=4, max_wait_s=0.0,
                                  preempt_keeps_kv=True, kv_host_bytes=host, max_batch_size=rng.randint(2, 6)))
    for i in range(4):
        s.add_model(f"m{i}", 512 * rng.randint(150, 300), KVT, cost=cost, slo=Slo(0.2, 0.02))
    lengths, n, now, moved_in, moved_out = {}, 0, 0.0, set(), set()
    for step in range(20_000):
        now += 0.01
        for _ in range(rng.choice([0, 0, 0, 1, 2])) if step < 1000 else ():
            r = SchedRequest(f"r{n}", f"m{rng.randrange(4)}", rng.randint(1, 24), rng.randint(1, 60), now)
            n += 1
            try:
                s.add_request(r)
                lengths[r.id] = r.max_tokens
            except ValueError:
                pass
        plan = s.schedule(now)
        assert not set(plan.kv_out) & set(plan.kv_in) and not set(plan.kv_out) & set(plan.preempted)
        moved_out |= set(plan.kv_out)
        moved_in |= set(plan.kv_in)
        for rid in plan.kv_in:  # its cache comes back with its model, and it decodes on (no prefill)
            assert s.requests[rid].model in plan.loads + plan.prefetch
        done = [rid for b in plan.batches for rid in b.requests if s.generated(rid) + 1 >= lengths[rid]]
        s.update(plan)
        for rid in done:
            s.finish(rid)
        for rid, _ in plan.failed:
            lengths.pop(rid, None)
        _check(s, budget, host)
        if not s.requests and step >= 1000:
            break
    assert not s.requests and s.host_used == 0 and s.kv_used[0] == 0
    if policy == "preempt-keep-kv":
        assert moved_out and moved_in


def test_slo_moves_a_cache_only_when_that_is_cheaper_than_recomputing():
    """The per-request choice: 2 x bytes over the model's link against a prefill of what it holds."""
    s = Scheduler(SchedulerConfig(budgets=10**7, policy="slo", block_tokens=4, kv_host_bytes=10**6))
    fast = ModelCost(load_s=0.001, prefill_fixed_s=0.01, prefill_token_s=0.001, decode_fixed_s=0.01, decode_seq_s=0)
    slow = ModelCost(load_s=10.0, prefill_fixed_s=0.01, prefill_token_s=0.001, decode_fixed_s=0.01, decode_seq_s=0)
    s.add_model("fast", 100_000, KVT, cost=fast)
    s.add_model("slow", 100_000, KVT, cost=slow)
    r = SchedRequest("r", "fast", 20, 10, 0.0, blocks=5)  # 20 tokens in 5 blocks of 4 (5 KiB)
    assert s.slo.moves(s.models["fast"], r)  # 2 x 5 KiB at 100 MB/s: 0.1 ms, against 30 ms of prefill
    assert not s.slo.moves(s.models["slow"], r)  # the same over a link 10,000 times slower: 1 s


def test_without_host_bytes_nothing_moves():
    s = Scheduler(SchedulerConfig(budgets=400_000, policy="preempt", preempt_keeps_kv=True, block_tokens=4))
    assert s.kv_host == 0
    s2 = Scheduler(SchedulerConfig(budgets=400_000, policy="default", kv_host_bytes=10**6))
    assert s2.kv_host == 0  # only policies that keep stopped requests' caches use it


@pytest.mark.parametrize("executor", ["inprocess", "workers"])
@pytest.mark.parametrize("policy", ["preempt", "slo"])
def test_caches_moved_to_host_and_back_match_undisturbed_runs(executor, policy):
    """Two models, room for one and not both's caches: under the preempt policy with no wait (and
    the slo policy), each arrival stops the other between decode steps; the caches that the next
    model's memory needs move to host memory instead of being recomputed, and come back before
    their model resumes them. Tokens, greedy and seeded, equal undisturbed runs; the prefills
    compute the prompts only (preempt policy; the slo policy's choices follow the real clock here);
    after every step the scheduler books the bytes the executor holds."""
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)]
    jobs = [("tiny-opt", list(range(5 + i, 25 + i)), sp) for i, sp in enumerate(params)] + \
           [("tiny-llama", list(range(7 + i, 19 + i)), sp) for i, sp in enumerate(params)]
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
    for m in ("tiny-opt", "tiny-llama"):
        ref.register_model(m)
    want = [ref.generate(m, p, sp).output_ids for m, p, sp in jobs]
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=870_000 if policy == "preempt" else 860_000, workspace_bytes=50_000, policy=policy,
                              max_wait_s=0.0, preempt_keeps_kv=True, kv_host_bytes=2**20, executor=executor,
                              slos={m: {"ttft_s": 30.0, "tpot_s": 1.0} for m in ("tiny-opt", "tiny-llama")}))
    try:
        for m in ("tiny-opt", "tiny-llama"):
            eng.register_model(m)
        reqs = [eng.submit(*job) for job in jobs[:2]]
        for _ in range(3):
            eng.step()
        reqs += [eng.submit(*job) for job in jobs[2:]]
        while not all(r.done for r in reqs):
            eng.step()
            mem = eng.memory()["devices"][0]
            assert mem["kv"] + mem["weights"] == mem["scheduled"]
            assert eng.core.scheduler.host_used <= 2**20
        assert [(r.finish_reason, r.error) for r in reqs] == [("length", None)] * 4
        assert [r.output_ids for r in reqs] == want
        st = eng.stats
        if policy == "preempt":  # without host memory some of these caches are recomputed (test_engine.py)
            assert st.get("kv_offloaded", 0) > 0 and st["kv_restored"] == st["kv_offloaded"]
            assert st["preemptions"] == 0 and st["prefill_tokens"] == sum(len(p) for _, p, _ in jobs)
            assert st["kv_moved_bytes"] > 0
        assert eng.memory()["kv"] == 0 and eng.core.scheduler.host_used == 0
    finally:
        eng.executor.shutdown()
