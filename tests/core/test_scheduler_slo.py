"""The slo policy on the pure scheduler: deadline order, switches when slack runs out, keep or
recompute per switch, refusals with their reason, and random runs within the budget."""

import random

import pytest

from computron.memory.units import kv_region_bytes
from computron.scheduler import ModelCost, SchedRequest, Scheduler, SchedulerConfig, Slo

KVT = 512  # bytes of KV cache per token
BT = 16
BLOCK = kv_region_bytes(BT, KVT)
COST = ModelCost(load_s=2.0, prefill_fixed_s=1.0, prefill_token_s=0.0, decode_fixed_s=1.0, decode_seq_s=0.0)
LOOSE = Slo(ttft_s=1000.0, tpot_s=10.0)


def _sched(budget, policy="slo", **kw):
    return Scheduler(SchedulerConfig(budgets=budget, policy=policy, block_tokens=BT, **kw))


def _step(s, now, made, ended):
    """One step at time ``now``: every request of a batch makes a token; those at their length end."""
    plan = s.schedule(now)
    for rid, _ in plan.failed:
        ended.append(rid)
    done = []
    for b in plan.batches:
        for rid in b.requests:
            made[rid] = made.get(rid, 0) + 1
            if s.generated(rid) + 1 >= s.requests[rid].max_tokens:
                done.append(rid)
    s.update(plan)
    for rid in done:
        s.finish(rid)
        ended.append(rid)
    return plan


def test_earliest_deadline_runs_first_where_the_default_runs_the_oldest():
    """a's request arrived first but is due at 0 + 1 + 99 * 0.01 = 1.99 s; b's, at 0.5 + 1 + 9 *
    0.01 = 1.59 s: the slo policy runs b first, the default a (both fit: no switch is involved)."""
    picked = {}
    for policy in ("default", "slo"):
        s = _sched(10_000_000, policy=policy)
        for m in "ab":  # a step of 1 ms: both requests can meet their deadlines
            s.add_model(m, 100_000, KVT, cost=ModelCost(0.01, 0.001, 0.0, 0.001, 0.0), slo=Slo(1.0, 0.01))
        s.add_request(SchedRequest("a0", "a", 4, 100, 0.0))
        s.add_request(SchedRequest("b0", "b", 4, 10, 0.5))
        picked[policy] = [b.model for b in s.schedule(0.6).batches]
    assert picked == {"default": ["a"], "slo": ["b"]}


def test_latency_slo_makes_every_request_due_alike():
    slo = Slo(1.0, 0.01, latency_s=3.0)
    assert slo.due(2.0, 1) == slo.due(2.0, 500) == 5.0
    assert Slo(1.0, 0.01).due(2.0, 11) == pytest.approx(3.1)
    with pytest.raises(ValueError, match="must be positive"):
        Slo(0.0, 0.01)


def test_cost_read_from_a_calibration():
    from computron.sim.costs import Calibration

    cal = Calibration(swap_bandwidth=(10e9,), hbm_bandwidth=1e15, prefill_fixed_s=0.004, prefill_token_s=1e-5,
                      prefill_token_s_per_byte=0.0, decode_fixed_s=0.002, decode_seq_s=3e-5, decode_seq_s_per_byte=0.0)
    c = ModelCost.from_calibration(cal, (2_000_000_000,), (0,))
    assert c.load_s == pytest.approx(0.2)
    assert c.prefill(100) == pytest.approx(cal.prefill_time(2_000_000_000, 100))
    assert c.decode(8) == pytest.approx(cal.decode_time(2_000_000_000, 8))
    solo = Slo.solo(c, 5.0, prompt=100)
    assert (solo.ttft_s, solo.tpot_s) == (pytest.approx(5 * c.prefill(100)), pytest.approx(5 * c.decode(1)))


def _hog(policy, budget, extra_model=False, max_wait=100.0, b_slo=Slo(ttft_s=10.0, tpot_s=1.0)):
    """a streams 100-token requests (loose SLO) on a device that holds one model; b's request arrives
    at t=5, 3 tokens, due at 5 + 10 + 2 * 1 = 17 s. Steps take 1 s. Returns (step b first ran, plan
    of that step, tokens made, requests ended)."""
    s = _sched(budget, policy=policy, max_batch_size=4, max_wait_s=max_wait)
    s.add_model("a", 700_000, KVT, cost=COST, slo=LOOSE)
    s.add_model("b", 700_000, KVT, cost=COST, slo=b_slo)
    if extra_model:
        s.add_model("c", 700_000, KVT, cost=COST, slo=LOOSE)
    made, ended, n, first = {}, [], 0, None
    for step in range(3000):
        now = float(step)
        if step % 3 == 0 and step < 60:
            s.add_request(SchedRequest(f"r{n}", "a", 4, 100, now))
            n += 1
        if step == 5:
            s.add_request(SchedRequest("b0", "b", 4, 3, now))
        if extra_model and step == 6:
            s.add_request(SchedRequest("c0", "c", 4, 3, now))
        plan = _step(s, now, made, ended)
        if first is None and any(b.model == "b" for b in plan.batches):
            first = (step, plan)
        if not s.requests:
            break
    assert not s.requests
    return first, made, ended, n


def test_a_waiting_model_switches_in_when_its_slack_runs_out_and_nothing_is_lost():
    """b's slack at time t is 17 - t - (load 2 + prefill 1 + 2 decodes) = 12 - t: the slo policy
    stops a between decode steps at t = 12 (the bound on waiting, 100 s, plays no part); the default
    drains a first. Room for a's caches beside b: a's requests keep them (paused), none recomputes."""
    budget = 1_300_000  # a model and its batch's cache: b cannot start beside a's running batch
    (step, plan), made, ended, n = _hog("slo", budget)
    assert step == 12 and "b" in plan.loads and plan.evictions == ["a"]
    assert plan.paused and not plan.preempted
    assert made["b0"] == 3 and all(made[f"r{i}"] == 100 for i in range(n))  # nothing lost or repeated
    (dstep, _), _, _, _ = _hog("default", budget)
    assert dstep >= 100


def test_a_starving_model_is_served_within_the_bound_on_waiting_even_with_a_loose_slo():
    """b's SLO is as loose as a's (its slack never runs out first), yet once it has waited the
    bound (10 s from t=5) a's batch is stopped for it."""
    (step, plan), made, _, n = _hog("slo", 1_300_000, max_wait=10.0, b_slo=LOOSE)
    assert step == 15 and "b" in plan.loads
    assert made["b0"] == 3 and all(made[f"r{i}"] == 100 for i in range(n))


def test_stopped_requests_recompute_when_their_memory_is_needed():
    """As above, with a third model waiting to load: the memory a's caches would keep is a model's
    weights that c needs next, so a's stopped requests give them up and recompute."""
    (step, plan), made, ended, n = _hog("slo", 1_300_000, extra_model=True)
    assert step == 12 and plan.preempted and not plan.paused
    assert made["b0"] == 3 and made["c0"] == 3 and all(made[f"r{i}"] >= 100 for i in range(n))
    assert sorted(ended) == sorted(["b0", "c0"] + [f"r{i}" for i in range(n)])


def test_admission_refuses_the_request_whose_work_would_make_others_late_with_the_reason():
    """Steps of 1 s, loads of 2 s. In deadline order: a0 (due 0 + 3 + 4 * 1 = 7 s) needs a load, a
    prefill and 4 steps, ending at 7; b0 (due 0 + 4 + 5 = 9 s) 8 s more, ending at 15; c0's SLO is
    loose. Both cannot be on time, so the one that needs more time, b0, is refused and a0 and c0 run."""
    s = _sched(2_000_000, max_wait_s=100.0)
    s.add_model("a", 500_000, KVT, cost=COST, slo=Slo(ttft_s=3.0, tpot_s=1.0))
    s.add_model("b", 500_000, KVT, cost=COST, slo=Slo(ttft_s=4.0, tpot_s=1.0))
    s.add_model("c", 500_000, KVT, cost=COST, slo=LOOSE)
    s.add_request(SchedRequest("c0", "c", 4, 5, 0.0))
    s.add_request(SchedRequest("b0", "b", 4, 6, 0.0))
    s.add_request(SchedRequest("a0", "a", 4, 5, 0.0))
    plan = s.schedule(0.0)
    assert [rid for rid, _ in plan.failed] == ["b0"] and "b0" not in s.requests
    assert [b.model for b in plan.batches] == ["a"] and "c" in plan.prefetch
    why = plan.failed[0][1]
    assert "model 'b' is overloaded" in why and "cannot be served within its SLO" in why and "retry later" in why
    assert "due 9.000 s after it arrived" in why


def test_a_request_its_slo_cannot_serve_even_alone_is_served_as_soon_as_it_can_be():
    """Due by its SLO at 5 s, it needs 2 + 1 + 4 = 7 s alone (a cold load longer than the time to first
    token): no scheduler could meet that, so it is not refused but due when it could end, at 7 s;
    a request of a second such model arriving with it is refused: together they end too late."""
    s = _sched(1_000_000)
    s.add_model("a", 500_000, KVT, cost=COST, slo=Slo(ttft_s=1.0, tpot_s=1.0))
    s.add_request(SchedRequest("a0", "a", 4, 5, 0.0))
    assert s.slo.due(s.requests["a0"]) == 7.0
    plan = s.schedule(0.0)
    assert not plan.failed and [b.model for b in plan.batches] == ["a"]
    s = _sched(1_000_000)
    for m in "ab":
        s.add_model(m, 500_000, KVT, cost=COST, slo=Slo(ttft_s=1.0, tpot_s=1.0))
        s.add_request(SchedRequest(f"{m}0", m, 4, 5, 0.0))
    plan = s.schedule(0.0)
    assert len(plan.failed) == 1 and "overloaded" in plan.failed[0][1]
    assert [b.model for b in plan.batches] == [m for m in "ab" if m + "0" in s.requests]


def test_no_refusal_while_the_deadline_can_still_be_met():
    s = _sched(1_000_000, max_wait_s=2.0)
    s.add_model("a", 500_000, KVT, cost=COST, slo=Slo(ttft_s=10.0, tpot_s=1.0))  # due at 19 s
    s.add_request(SchedRequest("a0", "a", 4, 10, 0.0))
    plan = s.schedule(2.5)  # ends at 2.5 + 2 + 1 + 9 = 14.5 <= 19
    assert not plan.failed and [b.model for b in plan.batches] == ["a"]


def test_the_slo_policy_needs_costs():
    s = _sched(1_000_000)
    with pytest.raises(ValueError, match="needs its cost"):
        s.add_model("a", 500_000, KVT)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_stay_within_the_budget_and_end_every_request(seed, devices):
    """Many models, random arrivals, lengths and SLOs, devices that hold two models each (with two
    devices, every third model is split over both): every step stays within the budgets, every
    request ends once (with all its tokens, or refused with its reason), and at this load every
    request starts within the bound on waiting (a few steps more)."""
    rng = random.Random(seed)
    weights = 200_000
    s = _sched((2 * weights + 30 * BLOCK,) * devices, max_batch_size=8, max_wait_s=3.0, models_per_step=1 + seed % 2)
    names = [f"m{i}" for i in range(8)]
    cost = ModelCost(load_s=0.2, prefill_fixed_s=0.05, prefill_token_s=0.0, decode_fixed_s=0.02, decode_seq_s=0.001,
                     shared_fraction=0.5)  # with two models a step (odd seeds), admission counts shared steps
    for i, name in enumerate(names):
        slo = Slo(ttft_s=rng.uniform(0.5, 1.5), tpot_s=rng.uniform(0.05, 0.15))
        if devices == 2 and i % 3 == 2:
            s.add_model(name, (weights // 2,) * 2, (KVT // 2,) * 2, devices=(0, 1), cost=cost, slo=slo)
        else:
            s.add_model(name, weights, KVT, devices=(i % devices,), cost=cost, slo=slo)
    arrivals = sorted((rng.uniform(0, 60), rng.choice(names), rng.randint(1, 120), rng.randint(1, 30))
                      for _ in range(150))
    made, ended, first, arrived = {}, [], {}, {}
    now, i = 0.0, 0
    while i < len(arrivals) or s.requests:
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, m, p, o = arrivals[i]
            s.add_request(SchedRequest(f"q{i}", m, p, o, t))
            arrived[f"q{i}"] = t
            i += 1
        plan = _step(s, now, made, ended)
        for d in range(len(s.config.budgets)):
            assert s.kv_used[d] + s.weights_used[d] <= s.config.budgets[d]
        for b in plan.batches:
            for rid in b.prefill:
                first.setdefault(rid, now)
        now += 0.2 if plan.loads else 0.02 if plan.batches else 0.05
        assert now < 1000, "the run does not end"
    assert sorted(ended) == sorted(arrived)  # each ended exactly once
    refused = set(ended) - set(made)
    for rid in made:  # those that ran made all their tokens (recomputed ones count theirs again)
        assert made[rid] >= arrivals[int(rid[1:])][3]
    assert len(refused) <= len(arrived) // 20
    late = [rid for rid, t in first.items() if t - arrived[rid] > 3.0 + 0.5]
    assert not late, late


@pytest.mark.parametrize("per_step", [1, 2])
def test_admission_counts_the_steps_models_share(per_step):
    """The refusal case above with both models resident and overlapping well in a shared step (each
    batch adds 0.1 of its time to a step another leads). One model a step: a0 needs 1 + 4 = 5 s, b0
    1 + 5 = 6 s more, ending at 11 s, past its 9: refused. Two a step: their work counts (1 + 0.1) / 2
    of its time, b0 ends by 0.55 * 11 = 6.05 s: nothing is refused, the step runs both batches."""
    from dataclasses import replace

    cost = replace(COST, shared_fraction=0.1)
    s = _sched(2_000_000, max_wait_s=100.0, models_per_step=per_step)
    s.add_model("a", 500_000, KVT, cost=cost, slo=Slo(ttft_s=3.0, tpot_s=1.0))
    s.add_model("b", 500_000, KVT, cost=cost, slo=Slo(ttft_s=4.0, tpot_s=1.0))
    for name in "ab":
        s.update(s.plan_load(name, 0.0))
        s.loaded(name)
    s.add_request(SchedRequest("b0", "b", 4, 6, 0.0))
    s.add_request(SchedRequest("a0", "a", 4, 5, 0.0))
    plan = s.schedule(0.0)
    if per_step == 1:
        assert [rid for rid, _ in plan.failed] == ["b0"]
    else:
        assert not plan.failed and sorted(b.model for b in plan.batches) == ["a", "b"]


def test_a_cost_from_a_calibration_carries_its_shared_step_fraction():
    from computron.sim.costs import Calibration

    cal = Calibration(name="t", concurrent_step_fraction=0.4)
    assert ModelCost.from_calibration(cal, (1000,), (0,)).shared_fraction == 0.4
    assert ModelCost.from_calibration(Calibration(name="t"), (1000,), (0,)).shared_fraction == 1.0


def test_models_not_on_the_device_share_no_step_in_admission():
    """The same two models, both to be loaded: until they are on the device their work is counted
    whole, as the refusal case above (b0 ends at 15 s, past its 9), even with two models a step."""
    from dataclasses import replace

    cost = replace(COST, shared_fraction=0.1)
    s = _sched(2_000_000, max_wait_s=100.0, models_per_step=2)
    s.add_model("a", 500_000, KVT, cost=cost, slo=Slo(ttft_s=3.0, tpot_s=1.0))
    s.add_model("b", 500_000, KVT, cost=cost, slo=Slo(ttft_s=4.0, tpot_s=1.0))
    s.add_request(SchedRequest("b0", "b", 4, 6, 0.0))
    s.add_request(SchedRequest("a0", "a", 4, 5, 0.0))
    assert [rid for rid, _ in s.schedule(0.0).failed] == ["b0"]
