"""The scheduler on pure state: no torch, invariants over thousands of random steps."""

import random
import subprocess
import sys

import pytest

from computron.scheduler import SchedRequest, Scheduler, SchedulerConfig


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import computron.scheduler, computron.parallel.dims, computron.models\n"
            "computron.models.get_preset(\"opt-13b\").kv_bytes_per_token()\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _req(i, model, prompt=4, max_tokens=3, kv=10, t=None):
    return SchedRequest(f"r{i}", model, prompt, max_tokens, kv, float(i if t is None else t))


def _run_step(s, finished_after):
    plan = s.schedule()
    done = []
    for rid in plan.prefill + plan.decode:
        r = s.requests[rid]
        if r.generated + 1 >= finished_after.get(rid, r.max_tokens):
            done.append(rid)
    s.update(plan, done)
    return plan


def test_one_model_fits_swaps_in_fcfs_order():
    s = Scheduler(SchedulerConfig(budget=150))
    for m in "abc":
        s.add_model(m, 100)
    for i, m in enumerate("abca"):
        s.add_request(_req(i, m, max_tokens=1))
    order = []
    for _ in range(10):
        plan = _run_step(s, {})
        if plan.model:
            order.append((plan.model, tuple(plan.loads), tuple(plan.evictions)))
    # The oldest request's model runs (both of a's requests in one batch); a new model evicts the
    # least recently used idle one.
    assert order == [("a", ("a",), ()), ("b", ("b",), ("a",)), ("c", ("c",), ("b",))]
    assert not s.requests


def test_iteration_level_batching_joins_running_batch():
    s = Scheduler(SchedulerConfig(budget=1000, max_batch_size=4))
    s.add_model("a", 100)
    s.add_request(_req(0, "a", max_tokens=5))
    p1 = s.schedule(); s.update(p1, [])
    s.add_request(_req(1, "a", max_tokens=5))
    p2 = s.schedule()
    assert p2.decode == ["r0"] and p2.prefill == ["r1"]


def test_max_batch_and_tokens_per_step():
    s = Scheduler(SchedulerConfig(budget=10_000, max_batch_size=2, max_tokens_per_step=10))
    s.add_model("a", 100)
    for i in range(4):
        s.add_request(_req(i, "a", prompt=4))
    p = s.schedule()
    assert p.prefill == ["r0", "r1"]  # batch size caps at 2
    s2 = Scheduler(SchedulerConfig(budget=10_000, max_batch_size=8, max_tokens_per_step=10))
    s2.add_model("a", 100)
    for i in range(4):
        s2.add_request(_req(i, "a", prompt=4))
    assert s2.schedule().prefill == ["r0", "r1"]  # 4+4 tokens fit, a third prompt would make 12


def test_prefetch_next_model_when_it_fits():
    s = Scheduler(SchedulerConfig(budget=250))
    for m in "ab":
        s.add_model(m, 100)
    s.add_request(_req(0, "a"))
    s.add_request(_req(1, "b"))
    p = s.schedule()
    assert p.model == "a" and p.loads == ["a"] and p.prefetch == ["b"]
    s2 = Scheduler(SchedulerConfig(budget=150))
    for m in "ab":
        s2.add_model(m, 100)
    s2.add_request(_req(0, "a"))
    s2.add_request(_req(1, "b"))
    assert s2.schedule().prefetch == []  # b would need a's memory, and a is busy


def test_pinned_model_never_evicted_and_blocked_request_fails():
    s = Scheduler(SchedulerConfig(budget=150))
    s.add_model("a", 100, pinned=True)
    s.add_model("b", 100)
    s.add_request(_req(0, "a", max_tokens=1))
    _run_step(s, {})
    s.add_request(_req(1, "b"))
    p = s.schedule()
    assert "a" not in p.evictions and p.model is None
    assert p.failed and p.failed[0][0] == "r1" and "pinned" in p.failed[0][1]
    assert not s.requests


def test_bad_input():
    s = Scheduler(SchedulerConfig(budget=100))
    with pytest.raises(ValueError, match="more than the whole budget of 100"):
        s.add_model("big", 101)
    s.add_model("a", 90)
    with pytest.raises(KeyError, match="unknown model 'zzz'; registered: a"):
        s.add_request(_req(0, "zzz"))
    with pytest.raises(ValueError, match="exceeds the budget"):
        s.add_request(_req(1, "a", kv=20))
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerConfig(budget=1, policy="lifo")


def test_computron_policy_counts_models():
    s = Scheduler(SchedulerConfig(budget=10**9, policy="computron", max_loaded=2))
    for m in "abc":
        s.add_model(m, 10**8)
    for i, m in enumerate("abc"):
        s.add_request(_req(i, m, max_tokens=1))
    models, evictions = [], []
    for _ in range(6):
        p = _run_step(s, {})
        models += [p.model] if p.model else []
        evictions += p.evictions
        assert len(s.resident_models()) <= 2
        assert p.prefetch == []
    assert models == ["a", "b", "c"] and evictions == ["a"]


@pytest.mark.parametrize("policy", ["default", "computron"])
@pytest.mark.parametrize("seed", range(5))
def test_random_steps_keep_invariants(policy, seed):
    rng = random.Random(seed)
    budget = 1000
    s = Scheduler(SchedulerConfig(budget=budget, policy=policy, max_loaded=2, max_batch_size=rng.randint(1, 6),
                                  max_tokens_per_step=rng.randint(8, 64)))
    sizes = {f"m{i}": rng.randint(100, 600) for i in range(5)}
    for m, b in sizes.items():
        s.add_model(m, b, pinned=(m == "m0" and seed % 2 == 0))
    lengths, n = {}, 0
    answered = set()
    for step in range(1000):
        for _ in range(rng.choice([0, 0, 1, 2])):
            m = rng.choice(list(sizes))
            kv = rng.randint(1, 300)
            try:
                s.add_request(SchedRequest(f"r{n}", m, rng.randint(1, 16), rng.randint(1, 6), kv, float(step)))
                lengths[f"r{n}"] = rng.randint(1, 6)
            except ValueError:
                pass
            n += 1
        if rng.random() < 0.02 and s.requests:  # a client goes away
            rid = rng.choice(list(s.requests))
            s.finish(rid)
            answered.add(rid)
        had_work = {m for m, st in s.models.items() if st.has_work}
        plan = _run_step(s, lengths)
        answered.update(r for r, _ in plan.failed)
        # A model with work is never evicted; pinned never evicted.
        assert not (set(plan.evictions) & had_work)
        assert "m0" not in plan.evictions or seed % 2
        # Bytes in use never exceed the budget.
        assert s.used_bytes() <= budget
        if policy == "computron":
            assert len(s.resident_models()) <= 2
        # Running requests always belong to resident models.
        for m in s.models.values():
            assert not m.running or m.resident
    # Draining: every request ends.
    for _ in range(5000):
        if not s.requests:
            break
        _run_step(s, lengths)
    assert not s.requests
