"""The scheduler on pure state: no torch, invariants over thousands of random steps."""

import random
import subprocess
import sys

import pytest

from computron.memory.units import kv_region_bytes
from computron.scheduler import SchedRequest, Scheduler, SchedulerConfig

KVT = 512  # bytes of KV cache per token in these tests' models
BT = 16  # tokens per KV block: a block is 8 KiB
BLOCK = kv_region_bytes(BT, KVT)


def test_wire_scheduler_and_engine_core_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import computron.messages, computron.scheduler, computron.engine.core, computron.engine\n"
            "import computron.parallel.dims, computron.models\n"
            "from computron.engine import Engine, EngineCore, SamplingParams\n"
            "computron.models.get_preset('opt-13b').kv_bytes_per_token()\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _req(i, model, prompt=4, max_tokens=3, t=None):
    return SchedRequest(f"r{i}", model, prompt, max_tokens, float(i if t is None else t))


def _sched(budgets, **kw):
    return Scheduler(SchedulerConfig(budgets=budgets, **{"block_tokens": BT, **kw}))


def _run_step(s, finished_after=None, now=0.0):
    """One step: schedule, then each request in a batch makes a token; those that reach their
    length end (``finished_after`` overrides max_tokens)."""
    plan = s.schedule(now)
    done = []
    for b in plan.batches:
        for rid in b.requests:
            r = s.requests[rid]
            if s.generated(rid) + 1 >= (finished_after or {}).get(rid, r.max_tokens):
                done.append(rid)
    s.update(plan)
    for rid in done:
        s.finish(rid)
    return plan


def _tally(plan, made: dict) -> None:
    """Count a token for each request the plan's batches ran."""
    for b in plan.batches:
        for rid in b.requests:
            made[rid] += 1


def _models(plan):
    return [b.model for b in plan.batches]


def test_one_model_fits_swaps_in_fcfs_order():
    s = _sched(150_000)
    for m in "abc":
        s.add_model(m, 100_000, KVT)
    for i, m in enumerate("abca"):
        s.add_request(_req(i, m, max_tokens=1))
    order = []
    for _ in range(10):
        plan = _run_step(s)
        if plan.batches:
            order.append((_models(plan)[0], tuple(plan.loads), tuple(plan.evictions)))
    # The oldest request's model runs (both of a's requests in one batch); a new model evicts the
    # least recently used idle one.
    assert order == [("a", ("a",), ()), ("b", ("b",), ("a",)), ("c", ("c",), ("b",))]
    assert not s.requests


def test_oldest_request_runs_first_even_when_another_model_is_resident():
    s = _sched(150_000)
    for m in "ab":
        s.add_model(m, 100_000, KVT)
    s.add_request(_req(0, "a", max_tokens=1))
    _run_step(s)  # a is resident and idle now
    s.add_request(_req(1, "b", max_tokens=1, t=1.0))
    s.add_request(_req(2, "a", max_tokens=1, t=2.0))  # newer, and its model is already there
    p = _run_step(s)
    assert _models(p) == ["b"] and p.evictions == ["a"] and p.loads == ["b"]


def test_iteration_level_batching_joins_running_batch():
    s = _sched(1_000_000, max_batch_size=4)
    s.add_model("a", 100_000, KVT)
    s.add_request(_req(0, "a", max_tokens=5))
    p1 = s.schedule()
    s.update(p1)
    s.add_request(_req(1, "a", max_tokens=5))
    p2 = s.schedule()
    assert p2.batches[0].decode == ["r0"] and p2.batches[0].prefill == ["r1"]
    assert s.generated("r0") == 1 and s.generated("r1") == 0


def test_max_batch_and_tokens_per_step():
    s = _sched(10_000_000, max_batch_size=2, max_tokens_per_step=10)
    s.add_model("a", 100_000, KVT)
    for i in range(4):
        s.add_request(_req(i, "a", prompt=4))
    assert s.schedule().batches[0].prefill == ["r0", "r1"]  # batch size caps at 2
    s2 = _sched(10_000_000, max_batch_size=8, max_tokens_per_step=10)
    s2.add_model("a", 100_000, KVT)
    for i in range(4):
        s2.add_request(_req(i, "a", prompt=4))
    assert s2.schedule().batches[0].prefill == ["r0", "r1"]  # 4+4 tokens fit, a third prompt would make 12


def test_prefetch_next_model_when_it_fits():
    s = _sched(260_000)
    for m in "ab":
        s.add_model(m, 100_000, KVT)
    s.add_request(_req(0, "a"))
    s.add_request(_req(1, "b"))
    p = s.schedule()
    assert _models(p) == ["a"] and p.loads == ["a"] and p.prefetch == ["b"]
    assert s.state("b") == "loading"
    s2 = _sched(160_000)
    for m in "ab":
        s2.add_model(m, 100_000, KVT)
    s2.add_request(_req(0, "a"))
    s2.add_request(_req(1, "b"))
    assert s2.schedule().prefetch == []  # b would need a's memory, and a is busy


def test_loading_state_and_estimated_ready_time():
    s = _sched(500_000, load_bandwidth=100_000.0)
    s.add_model("a", 200_000, KVT)
    s.add_request(_req(0, "a"))
    p = s.schedule(now=10.0)
    assert p.loads == ["a"] and s.state("a") == "loading" and s.models["a"].ready_at == 12.0
    s.loaded("a")
    assert s.state("a") == "resident" and s.models["a"].ready_at is None


def test_update_advances_several_decode_steps_at_once():
    s = _sched(1_000_000)
    s.add_model("a", 100_000, KVT)
    s.add_request(_req(0, "a", max_tokens=50))
    s.update(s.schedule())
    s.update(s.schedule(), steps=10)
    assert s.generated("r0") == 11


def test_pinned_model_never_evicted_and_blocked_request_fails():
    s = _sched(150_000)
    s.add_model("a", 100_000, KVT, pinned=True)
    s.add_model("b", 100_000, KVT)
    s.add_request(_req(0, "a", max_tokens=1))
    _run_step(s)
    s.add_request(_req(1, "b"))
    p = s.schedule()
    assert "a" not in p.evictions and not p.batches
    assert p.failed and p.failed[0][0] == "r1" and "pinned models (a)" in p.failed[0][1]
    assert not s.requests


def test_a_model_with_steady_traffic_does_not_starve_another():
    """Budget for one model; a always has running requests; b's one request arrived before most of
    a's. b is served once the a requests older than it have drained; a then resumes."""
    s = _sched(260_000, max_batch_size=8)  # one model and a full batch; never two models
    for m in "ab":
        s.add_model(m, 150_000, KVT)
    n, now, b_served_at = 0, 0.0, None
    s.add_request(_req(n, "a", max_tokens=20, t=now))
    for step in range(300):
        now = float(step)
        if step % 3 == 0:  # a steady stream to a: its batch never empties on its own
            n += 1
            s.add_request(_req(n, "a", max_tokens=20, t=now))
        if step == 5:
            s.add_request(SchedRequest("b0", "b", 4, 3, now))
        p = _run_step(s, now=now)
        if "b" in _models(p) and b_served_at is None:
            b_served_at = step
    assert b_served_at is not None
    # The a requests that arrived before b (t <= 5) have 20 tokens each: b runs right after them.
    assert b_served_at <= 5 + 20 + 2
    assert "b0" not in s.requests
    assert any(r.model == "a" and r.state == "running" for r in s.requests.values())  # a resumed


def test_preempt_policy_serves_the_waiting_model_within_the_bound_and_a_resumes():
    """As above, with a's generations 100 tokens long: draining keeps b waiting until a's older
    requests end; the preempt policy stops a's batch once b has waited max_wait_s, and a's stopped
    requests finish with every token: paused, their caches kept (they fit beside b), or, with
    ``preempt_keeps_kv`` off, recomputed."""
    served = {}
    for policy, keeps in (("default", False), ("preempt-keep-kv", True), ("preempt", False)):
        s = _sched(1_300_000, max_batch_size=4, policy=policy.split("-")[0], max_wait_s=10.0,
                   preempt_keeps_kv=keeps)  # one model + its batch's cache
        for m in "ab":
            s.add_model(m, 700_000, KVT)
        n, made, preempted, paused = 0, {}, [], []
        for step in range(3000):
            now = float(step)
            if step % 3 == 0 and step < 120:
                s.add_request(_req(n, "a", max_tokens=100, t=now))
                made[f"r{n}"] = 0
                n += 1
            if step == 5:
                s.add_request(SchedRequest("b0", "b", 4, 3, now))
                made["b0"] = 0
            p = _run_step(s, now=now)
            preempted += p.preempted
            paused += p.paused
            for b in p.batches:
                for rid in b.requests:
                    made[rid] += 1
            if "b" in _models(p) and policy not in served:
                served[policy] = step
            if not s.requests:
                break
        assert not s.requests, policy
        assert all(v == (3 if k == "b0" else 100) for k, v in made.items())  # nothing lost or repeated
        if policy == "preempt-keep-kv":
            assert paused and not preempted and s.switches >= 1
        if policy == "preempt":
            assert preempted and not paused and s.switches >= 1
    assert served["default"] >= 100  # r0 and r1, older than b, drained first
    assert served["preempt-keep-kv"] <= 5 + 10 + 2  # b waited the bound, then a's batch stopped
    assert served["preempt"] <= 5 + 10 + 2


def test_kv_blocked_request_makes_others_drain_instead_of_failing():
    s = _sched(400_000)  # both models (200 kB) fit, and r0 beside them, but not r0 and r1
    s.add_model("a", 100_000, KVT)
    s.add_model("b", 100_000, KVT)
    s.add_request(_req(0, "a", prompt=100, max_tokens=200))  # 153.6 kB of KV cache
    p = _run_step(s)
    assert _models(p) == ["a"]
    s.add_request(_req(1, "b", prompt=100, max_tokens=300, t=1.0))  # 204.8 kB: must wait for a's
    s.add_request(_req(2, "a", prompt=100, max_tokens=200, t=2.0))  # newer: must not jump ahead of b
    for _ in range(250):
        p = _run_step(s)
        assert not p.failed
        if "b" in _models(p):
            break
    assert "r1" in p.batches[0].prefill and "r2" in s.requests and s.requests["r2"].state == "waiting"


def test_devices_run_disjoint_batches_and_a_two_device_model_needs_both():
    s = _sched((150_000, 150_000))
    s.add_model("a", 100_000, KVT, devices=(0,))
    s.add_model("b", 100_000, KVT, devices=(1,))
    s.add_model("ab", (60_000, 60_000), (KVT, KVT), devices=(0, 1))  # tp=2: half on each device
    s.add_request(_req(0, "a", max_tokens=2))
    s.add_request(_req(1, "b", max_tokens=2))
    s.add_request(_req(2, "ab", max_tokens=2))
    p = _run_step(s)
    assert sorted(_models(p)) == ["a", "b"] and p.loads == ["a", "b"]
    assert s.free_bytes(0) == 150_000 - 100_000 - BLOCK  # a 4-token prompt: one block
    _run_step(s)
    p = _run_step(s)  # a and b are idle now; ab evicts both, one per device
    assert _models(p) == ["ab"] and sorted(p.evictions) == ["a", "b"]
    assert s.free_bytes(0) == s.free_bytes(1) == 150_000 - 60_000 - BLOCK


def test_bad_input():
    s = _sched(100_000)
    with pytest.raises(ValueError, match="more than its whole budget of 100000"):
        s.add_model("big", 100_001, KVT)
    with pytest.raises(ValueError, match="placed on device 1, but there are 1 devices"):
        s.add_model("far", 10, KVT, devices=(1,))
    s.add_model("a", 90_000, KVT)
    with pytest.raises(KeyError, match="unknown model 'zzz'; registered: a"):
        s.add_request(_req(0, "zzz"))
    with pytest.raises(ValueError, match="exceeds the budget"):
        s.add_request(_req(1, "a", prompt=40, max_tokens=20))
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerConfig(budgets=1, policy="lifo")


def test_computron_policy_counts_models():
    s = _sched(10**9, policy="computron", max_loaded=2)
    for m in "abc":
        s.add_model(m, 10**8, KVT)
    for i, m in enumerate("abc"):
        s.add_request(_req(i, m, max_tokens=1))
    models, evictions = [], []
    for _ in range(6):
        p = _run_step(s)
        models += _models(p)
        evictions += p.evictions
        assert len(s.resident_models()) <= 2
        assert p.prefetch == []
    assert models == ["a", "b", "c"] and evictions == ["a"]


def test_a_request_that_cannot_grow_preempts_the_newest_and_both_finish():
    """Blocks are taken as sequences grow. Two requests fit at first but not at full length: the
    newer is preempted (its blocks freed), waits, and resumes from where it was (recompute)."""
    small = kv_region_bytes(4, KVT)
    s = _sched(100_000 + 5 * small, block_tokens=4)
    s.add_model("a", 100_000, KVT)
    s.add_request(_req(0, "a", prompt=4, max_tokens=8))  # 12 tokens: 3 blocks at the end
    s.add_request(_req(1, "a", prompt=4, max_tokens=8))
    made = {"r0": 0, "r1": 0}
    preempted = []
    for _ in range(40):
        p = _run_step(s)
        preempted += p.preempted
        _tally(p, made)
        assert s.free_bytes(0) >= 0
        if not s.requests:
            break
    assert preempted == ["r1"]
    assert made == {"r0": 8, "r1": 8}  # r1's recompute made its next token: no step was lost or repeated
    assert not s.requests and s.free_bytes(0) == 5 * small


def test_requeue_after_a_restart_keeps_every_request_and_its_progress():
    """A model's workers restarted: its running requests wait again (oldest first, at the head of
    the queue, before newer waiting ones), their blocks and weights are freed, and each finishes
    with exactly its max_tokens after the model is loaded again."""
    s = _sched(150_000)
    s.add_model("a", 100_000, KVT)
    for i in range(2):
        s.add_request(_req(i, "a", max_tokens=6))
    made = {"r0": 0, "r1": 0, "r2": 0}
    for _ in range(3):
        _tally(_run_step(s), made)
    s.add_request(_req(2, "a", max_tokens=6))
    assert s.requeue("a") == ["r1", "r0"]  # the newest goes to the head first, so the oldest ends first
    assert s.state("a") == "offloaded" and s.free_bytes(0) == 150_000
    assert [r.id for r in s.models["a"].waiting] == ["r0", "r1", "r2"]
    assert s.generated("r0") == 3 and s.generated("r1") == 3
    loads = []
    for _ in range(20):
        p = _run_step(s)
        loads += p.loads
        _tally(p, made)
        if not s.requests:
            break
    assert loads == ["a"] and made == {"r0": 6, "r1": 6, "r2": 6}
    assert s.free_bytes(0) == 150_000 - 100_000


@pytest.mark.parametrize("policy", ["default", "preempt", "preempt-keep-kv", "computron"])
@pytest.mark.parametrize("seed", range(5))
def test_random_steps_keep_invariants(policy, seed):
    rng = random.Random(seed)
    budget = 512_000
    s = _sched(budget, policy=policy.split("-")[0], max_loaded=2, max_batch_size=rng.randint(1, 6),
               max_tokens_per_step=rng.randint(8, 64), block_tokens=4, max_wait_s=rng.choice([0.0, 3.0, 20.0]),
               preempt_keeps_kv=policy == "preempt-keep-kv", models_per_step=1 + seed % 3)
    sizes = {f"m{i}": 512 * rng.randint(100, 600) for i in range(5)}
    for m, b in sizes.items():
        s.add_model(m, b, KVT, pinned=(m == "m0" and seed % 2 == 0))
    lengths, reqs, n = {}, {}, 0
    on_device, held, made, paused = set(), {}, {}, set()  # what the plans say, tracked here independently
    kept = resumed = 0
    for step in range(1000):
        for _ in range(rng.choice([0, 0, 1, 2])):
            m = rng.choice(list(sizes))
            r = SchedRequest(f"r{n}", m, rng.randint(1, 16), rng.randint(1, 150), float(step))
            try:
                s.add_request(r)
                # Most end early (EOS); a few run long, to grow their caches past other requests'.
                lengths[r.id] = rng.randint(1, r.max_tokens if rng.random() < 0.1 else min(6, r.max_tokens))
                reqs[r.id], made[r.id] = (m, r.prompt_len), 0
            except ValueError:
                pass
            n += 1
        if rng.random() < 0.02 and s.requests:  # a client goes away
            rid = rng.choice(list(s.requests))
            s.finish(rid)
            held.pop(rid, None)
            paused.discard(rid)
        plan = _run_step(s, lengths, now=float(step))
        # A model with running requests is never evicted (one whose requests this step preempted may
        # be: they lost their cache already; or paused: they keep it); a pinned one never.
        busy = {reqs[r][0] for r in held if r not in plan.preempted and r not in plan.paused and r not in paused}
        assert not (set(plan.evictions) & busy)
        assert "m0" not in plan.evictions or seed % 2
        on_device = (on_device - set(plan.evictions)) | set(plan.loads) | set(plan.prefetch)
        assert on_device == set(s.resident_models())
        for rid in plan.preempted:
            held.pop(rid, None)
            paused.discard(rid)
        assert not set(plan.paused) & set(plan.preempted)
        paused |= set(plan.paused)
        kept += len(plan.paused)
        for b in plan.batches:
            for rid in b.prefill:
                assert rid not in paused  # a paused request resumes as a decode, its cache as it was
            for rid in b.decode:
                if rid in paused:
                    assert held[rid] == -(-(reqs[rid][1] + made[rid] - 1) // 4)
                    paused.discard(rid)
                    resumed += 1
        # Pausing evicts the model (a paused request's model is off the device until it is loaded
        # again, and its requests then run on); their blocks stay booked (``held`` keeps them).
        assert {reqs[r][0] for r in plan.paused} <= set(plan.evictions)
        assert all(reqs[r][0] not in on_device for r in paused if s.requests[r].state == "paused")
        for b in plan.batches:
            for rid in b.requests:  # its cache holds its prompt and the tokens it had made
                held[rid] = -(-(reqs[rid][1] + made[rid]) // 4)
                made[rid] += 1
        held = {r: n for r, n in held.items() if r in s.requests}
        # Bytes in use, summed here from the sizes, never exceed the budget.
        weights = sum(sizes[m] for m in on_device) if policy != "computron" else 0
        kv = sum(held.values()) * kv_region_bytes(4, KVT)
        assert weights + kv <= budget
        assert s.free_bytes(0) == budget - weights - kv
        if policy == "computron":
            assert len(on_device) <= 2
        # Batches run only models on the device.
        assert set(_models(plan)) <= on_device
        assert len(plan.batches) <= 1 + seed % 3 and len(set(_models(plan))) == len(plan.batches)
    # Draining: every request ends.
    for _ in range(20_000):
        if not s.requests:
            break
        _run_step(s, lengths)
    assert not s.requests
    assert s.kv_used[0] == 0
    assert (kept > 0 and resumed > 0) if policy == "preempt-keep-kv" else kept == 0

@pytest.mark.parametrize("rate", [0.05, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_steady_steps_plan_exactly_what_the_full_search_plans(seed, rate):
    """After a step that only decoded one model, with nothing changed since but arrivals that
    queue behind others of their model, the scheduler skips its search; a twin that always
    searches must make the same plans, step for step."""
    plans, shortcuts = [], 0
    for shortcut in (True, False):
        rng = random.Random(seed)
        s = _sched(400_000, max_batch_size=rng.randint(2, 8), block_tokens=4)
        for i in range(3):
            s.add_model(f"m{i}", 512 * rng.randint(100, 300), KVT)
        lengths, out, n = {}, [], 0
        for step in range(600):
            if rng.random() < rate:
                r = SchedRequest(f"r{n}", f"m{rng.randrange(3)}", rng.randint(1, 16), rng.randint(1, 80), float(step))
                queued = s.joins_queue(r.model, r.arrival)
                if shortcut and queued and s._steady is not None and s._steady[0] == (s._epoch, s._changes):
                    shortcuts += 1  # a steady batch that goes on past this arrival
                s.add_request(r)
                lengths[r.id] = rng.randint(1, r.max_tokens)
                n += 1
            if not shortcut:
                s._steady = None  # no steady batch to go on with: the full search, every step
            p = _run_step(s, lengths, now=float(step))
            out.append((p.evictions, p.loads, p.prefetch, p.preempted, p.failed,
                        [(b.model, b.prefill, b.decode) for b in p.batches]))
        plans.append(out)
    assert plans[0] == plans[1]
    if rate > 0.1:
        assert shortcuts > 10


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_plans_kept_across_finishes_are_what_the_full_search_plans(seed, devices):
    """Requests of the one model a step decoded end, and the scheduler keeps its batch without a
    search where nothing could use the memory they freed (``_keeps``); a twin that searches after
    every finish must make the same plans, step for step, under memory pressure, with models that
    wait for it, on one device or two (one model on both, one alone on the second)."""
    layout = [(0,), (0,), (0,), (0,)] if devices == 1 else [(0,), (0,), (1,), (0, 1)]
    plans, kept = [], 0
    for shortcut in (True, False):
        rng = random.Random(seed)
        s = _sched((400_000,) * devices, max_batch_size=rng.randint(8, 16), block_tokens=4)
        for i, on in enumerate(layout):
            s.add_model(f"m{i}", (512 * rng.randint(200, 300),) * len(on), (KVT,) * len(on), devices=on)
        lengths, out, n = {}, [], 0
        for step in range(800):
            if rng.random() < 0.5:  # some arrive late (an older arrival time): the order by age changes
                r = SchedRequest(f"r{n}", f"m{rng.randrange(4)}", rng.randint(1, 40), rng.randint(1, 60),
                                 float(step - rng.choice([0, 0, 0, 30])))
                s.add_request(r)
                lengths[r.id] = rng.randint(1, r.max_tokens)
                n += 1
            if not shortcut and s._recheck:
                s._steady = None  # the full search after every finish
            rechecking, before = s._recheck, s._steady
            p = _run_step(s, lengths, now=float(step))
            kept += shortcut and rechecking and p.batches != [] and s._steady is before
            out.append((p.evictions, p.loads, p.prefetch, p.preempted, p.failed,
                        [(b.model, b.prefill, b.decode) for b in p.batches]))
        plans.append(out)
    assert plans[0] == plans[1]
    assert kept > 10


def test_a_finish_that_frees_a_place_in_the_batch_admits_the_next_request():
    """The batch was full: once one of its requests ends, the waiting one joins (no plan is kept)."""
    s = _sched(10**6, max_batch_size=2)
    s.add_model("a", 1000, KVT)
    for i in range(3):
        s.add_request(_req(i, "a", max_tokens=2 if i == 0 else 5))
    assert _run_step(s).loads == ["a"]
    p = _run_step(s)  # r0 makes its last token
    assert p.batches[0].decode == ["r0", "r1"] and "r0" not in s.requests
    p = _run_step(s)
    assert p.batches[0].prefill == ["r2"] and p.batches[0].decode == ["r1"]


def test_a_finish_that_makes_another_running_model_the_oldest_hands_it_the_device():
    """The oldest request of the model decoding ends: a model on the same device whose requests
    are older now than all it has left takes the device (no plan is kept)."""
    s = _sched(10**6)
    s.add_model("a", 1000, KVT)
    s.add_model("b", 1000, KVT)
    s.add_request(_req(0, "b", max_tokens=50, t=1.0))
    _run_step(s)  # b loads, r0 starts
    s.add_request(_req(1, "a", max_tokens=2, t=0.0))  # a request older than r0, seen late
    s.add_request(_req(2, "a", max_tokens=50, t=1.5))
    assert _models(_run_step(s)) == ["a"]  # a loads, is the oldest: it takes the device
    p = _run_step(s)  # r1 makes its last token
    assert _models(p) == ["a"] and "r1" not in s.requests
    assert _models(_run_step(s)) == ["b"]  # r0 (1.0) is older than r2 (1.5)


def test_a_finish_that_frees_room_for_a_waiting_models_weights_prefetches_it():
    """A model waits, its weights not fitting beside the running requests' KV cache; once a long
    prompt's request ends they fit, and it is loaded (no plan is kept)."""
    s = _sched(200_000)
    s.add_model("a", 50_000, KVT)
    s.add_model("x", 100_000, KVT)
    s.add_request(_req(0, "a", prompt=160, max_tokens=3, t=0.0))  # 10 blocks and more: 80 KiB
    s.add_request(_req(1, "a", prompt=4, max_tokens=50, t=1.0))
    assert _run_step(s).loads == ["a"]
    s.add_request(_req(2, "x", t=5.0))
    p = _run_step(s)
    assert _models(p) == ["a"] and not p.prefetch  # x does not fit: a decodes on
    p = _run_step(s)  # r0 makes its last token
    assert _models(p) == ["a"] and not p.prefetch and "r0" not in s.requests
    p = _run_step(s)
    assert _models(p) == ["a"] and p.prefetch == ["x"]


def _drive(s, rng, steps, arriving, max_tokens, lengths, after, early_end=0.0):
    """The simulator's way of driving ``s``: for ``arriving`` steps a request arrives with chance 0.3 (one of
    models m0-m2, prompts of 1-16 tokens, 1 to ``max_tokens`` tokens), each call runs up to a length drawn
    from ``lengths``, requests end by length (or, with chance ``early_end``, at any step), and ``after(plan)``
    sees each plan; it stops once every request has ended after the arrivals."""
    n, now = 0, 0.0
    for step in range(steps):
        if step < arriving and rng.random() < 0.3:
            s.add_request(SchedRequest(f"r{n}", f"m{rng.randrange(3)}", rng.randint(1, 16),
                                       rng.randint(1, max_tokens), now))
            n += 1
        plan = s.schedule(now, max_steps=rng.choice(lengths))
        s.update(plan, plan.steps)
        now += plan.steps
        for b in plan.batches:
            for rid in b.requests:
                if s.generated(rid) >= s.requests[rid].max_tokens or early_end and rng.random() < early_end:
                    s.finish(rid)
        after(plan)
        if step >= arriving and not s.requests:
            break


@pytest.mark.parametrize("policy", ["default", "preempt", "preempt-keep-kv"])
@pytest.mark.parametrize("seed", range(3))
def test_runs_of_several_steps_keep_the_books(policy, seed):
    """Steps of random lengths (schedule(max_steps=k), as the simulator drives it), under KV
    pressure and preemption: memory never goes negative, and once every request has ended no
    block is left booked."""
    rng = random.Random(seed)
    budget = 400_000
    s = _sched(budget, policy=policy.split("-")[0], max_batch_size=rng.randint(2, 8), block_tokens=4,
               max_wait_s=2.0, preempt_keeps_kv=policy == "preempt-keep-kv")
    for i in range(3):
        s.add_model(f"m{i}", 512 * rng.randint(100, 250), KVT)

    def books(plan):
        assert s.kv_used[0] >= 0 and s.free_bytes(0) >= 0
        for r in s.requests.values():  # a running request holds the blocks its tokens fill, no more
            if r.state in ("running", "paused"):
                assert r.blocks == -(-(r.prompt_len + s.generated(r.id) - 1) // 4), r

    _drive(s, rng, 3000, 1500, 60, [1, 2, 5, 50], books, early_end=0.01)
    assert not s.requests
    assert s.kv_used[0] == 0


def _growth_books(s):
    """Each model's live growth entries in the heap's order, as (due step, request), and the tie counter:
    what later steps read of the growth heaps (stale entries and the ties' values aside)."""
    books = {}
    for name, m in s.models.items():
        live = sorted((due, tie, req.id) for due, tie, req in m.growth if req.state == "running" and req.due == tie)
        books[name] = [(due, rid) for due, _, rid in live]
    return books, s._ties


@pytest.mark.parametrize("policy", ["default", "preempt"])
@pytest.mark.parametrize("seed", range(3))
def test_a_runs_blocks_granted_at_once_match_one_at_a_time(policy, seed):
    """Long runs grant every block their requests need in one pass where all fit (``_grant_all``). Twin
    runs, with and without it, under KV pressure and preemption, with prompts that make many requests
    need blocks at the same steps: the same plans, and the same growth books after every step (the
    order among entries of one step included, which decides who grows first in a short step)."""
    def run(at_once):
        rng = random.Random(seed)
        s = _sched(300_000, policy=policy, max_batch_size=rng.randint(4, 12), block_tokens=4, max_wait_s=2.0)
        s._at_once = at_once
        for i in range(3):
            s.add_model(f"m{i}", 512 * rng.randint(100, 200), KVT)
        out = []
        _drive(s, rng, 2500, 1200, 90, [1, 3, 20, 60], lambda plan: out.append((
            [(b.model, b.prefill, b.decode) for b in plan.batches], plan.steps, plan.preempted, plan.evictions,
            plan.loads, _growth_books(s))))
        return out, s.at_once

    with_bulk, (granted, refused) = run(True)
    assert granted > 50 and refused > 0  # granted at once often, and refused where they did not all fit
    without, counts = run(False)
    assert counts == [0, 0] and without == with_bulk


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_that_repeats_is_followed_by_the_same_batch(seed):
    """``plan.repeats`` (single steps): when nothing arrives and requests end only by length, the
    next plan is that same decode batch, one step on; and after a quiet step (one batch, decodes
    only, no memory change) it is given whenever that is so."""
    rng = random.Random(seed)
    s = _sched(4_000_000, max_batch_size=rng.randint(2, 8), block_tokens=4)
    for i in range(2):
        s.add_model(f"m{i}", 512 * rng.randint(100, 300), KVT)
    prev, n, repeated, missed = None, 0, 0, 0
    for step in range(1500):
        arrived = step < 1200 and rng.random() < 0.1
        if arrived:
            s.add_request(SchedRequest(f"r{n}", f"m{rng.randrange(2)}", rng.randint(1, 16), rng.randint(1, 40),
                                       float(step)))
            n += 1
        plan = _run_step(s, now=float(step))
        same = prev is not None and len(plan.batches) == 1 and not plan.batches[0].prefill and \
            [(b.model, b.decode) for b in prev.batches] == [(b.model, b.decode) for b in plan.batches]
        if prev is not None and prev.repeats and not arrived:
            assert same and plan.steps == 1 and not (plan.loads or plan.evictions or plan.preempted)
            repeated += 1
        elif prev is not None and same and not arrived and not prev.batches[0].prefill and \
                not (prev.prefetch or prev.loads or prev.evictions or prev.preempted or prev.failed):
            missed += 1  # a quiet step followed by the same batch, though not foretold
        prev = plan
    assert repeated > 300 and missed == 0
    s.add_request(SchedRequest("long", "m0", 4, 50, 2000.0))
    s.schedule(2000.0)
    assert not s.schedule(2001.0, max_steps=8).repeats  # runs of several steps: no single step foretold


def test_a_share_below_the_budget_holds_a_request_until_it_grows_and_only_then_fails_it():
    """Colocation: training holds part of the budget. A model that does not fit the share waits for
    it to grow (the engine's link asks training for memory); it fails only when the whole budget
    cannot hold it beside a pinned model."""
    s = _sched(250_000)
    s.add_model("a", 100_000, KVT, pinned=True)
    s.add_model("b", 100_000, KVT)
    s.add_model("c", 200_000, KVT)
    s.add_request(_req(9, "a", max_tokens=1))
    _run_step(s)  # a is resident, and stays (pinned)
    s.set_budget(0, 150_000)  # training took the rest
    s.add_request(_req(0, "b"))
    p = s.schedule()
    assert not p.failed and not p.loads and not p.batches
    s.set_budget(0, 250_000)
    p = _run_step(s)
    assert not p.failed and p.loads == ["b"]
    s.add_request(_req(1, "c"))
    while "r0" in s.requests:
        assert not _run_step(s).failed
    s.set_budget(0, 150_000)
    assert not s.schedule().failed and "r1" in s.requests  # held while the share is short of the budget
    s.set_budget(0, 250_000)
    p = s.schedule()
    assert p.failed and p.failed[0][0] == "r1" and "pinned models (a)" in p.failed[0][1]


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_models_per_step_lets_that_many_models_share_a_device_step(per_step):
    """Three resident models with work on one device: a step runs up to ``models_per_step`` of
    their batches (oldest first), every request still finishes, and memory stays in the budget."""
    s = _sched(400_000, models_per_step=per_step)
    for name in "abc":
        s.add_model(name, 100_000, KVT)
    for i, name in enumerate("abc"):
        s.add_request(_req(i, name, max_tokens=4))
    made = {f"r{i}": 0 for i in range(3)}
    plans = []
    for _ in range(20):
        p = _run_step(s)
        _tally(p, made)
        if not p.batches:
            break
        plans.append(p)
        assert s.free_bytes(0) >= 0
    assert made == {f"r{i}": 4 for i in range(3)}
    assert max(len(p.batches) for p in plans) == per_step
    assert _models(plans[0]) == ["a", "b", "c"][:per_step]  # the oldest requests' models first
    assert len(plans) == {1: 12, 2: 8, 3: 4}[per_step]  # 12 batches of one token, per_step a step


def test_models_per_step_counts_each_device_of_a_sharded_model():
    s = _sched((400_000, 400_000), models_per_step=2)
    s.add_model("a", 100_000, KVT, devices=(0,))
    s.add_model("b", 100_000, KVT, devices=(0,))
    s.add_model("ab", (60_000, 60_000), (KVT, KVT), devices=(0, 1))
    s.add_model("c", 100_000, KVT, devices=(1,))
    for i, name in enumerate(["a", "b", "ab", "c"]):
        s.add_request(_req(i, name, max_tokens=2))
    p = _run_step(s)  # device 0 is full with a and b: ab waits, c has device 1 to itself
    assert sorted(_models(p)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="models_per_step must be at least 1, got 0"):
        _sched(1000, models_per_step=0)


@pytest.mark.parametrize("case", ["memory", "token budget", "preempt policy", "executor without such runs"])
def test_a_step_that_admits_starts_a_run_only_while_what_stopped_admission_holds(case):
    """Where the executor runs batches of several steps whose first prefills (``prefill_runs``, the
    simulator's), a step that admits a request starts such a run when admission stopped for memory:
    that holds until a request ends, so the steps after would decode the same batch. Not when it
    stopped at the token budget (the next step admits more), not under a preempting policy, and not
    where the executor lacks such runs; there the next step still decodes the batch without a search."""
    weights = 100_000
    kw = dict(prefill_runs=case != "executor without such runs",
              policy="preempt" if case == "preempt policy" else "default")
    if case == "token budget":
        s = _sched((weights + 20 * BLOCK,), max_tokens_per_step=50, **kw)
    else:  # the model, then KV for 7 blocks: two requests of 3 (40 + 8 tokens), not a third
        s = _sched((kv_region_bytes(1, weights) + 7 * BLOCK,), **kw)
    s.add_model("a", weights, KVT)
    s.add_request(_req(0, "a", prompt=40, max_tokens=8))
    first = s.schedule(0.0, max_steps=50)
    assert first.loads == ["a"] and first.steps == 1  # a load: no run
    s.update(first)
    s.loaded("a")
    for i in (1, 2):
        s.add_request(_req(i, "a", prompt=40, max_tokens=8))
    s.requests["r1"].done = 3  # preempted after 3 tokens: its prefill recomputes them with the prompt
    asked = []
    plan = s.schedule(1.0, max_steps=lambda *a: asked.append(a) or 50)  # a driver's bound, given the batch
    assert [(b.prefill, b.decode) for b in plan.batches] == [(["r1"], ["r0"])]  # r2 left waiting
    if case == "memory":
        assert plan.steps == 5  # r1's last token (its 8th, 3 made before) in the run's last step
        assert asked == [("a", 2, (43, 1), [])]  # the first step prefills one prompt of 40 + 3 tokens (a run begun)
    else:
        assert asked == [] and plan.steps == 1  # a single step: no bound asked
        s.update(plan)
        # the steady batch: the next step decodes it without a search
        assert (s._steady is not None) == (case == "executor without such runs")
        after = s.schedule(1.1, max_steps=50)
        want = [(["r2"], ["r0", "r1"])] if case == "token budget" else [([], ["r0", "r1"])]
        assert [(b.prefill, b.decode) for b in after.batches] == want and after.steps > 1
