"""The scheduler lends idle host links to striped swap-ins (pure state, no torch): only links of
stripe devices with no load in flight, the staging booked on each helper's budget while the load
runs and returned when it ends (or is undone), never to a sharded model."""

import pytest

from computron.memory.units import kv_region_bytes
from computron.scheduler import SchedRequest, Scheduler, SchedulerConfig

BT, KVT = 16, 512
BLOCK = kv_region_bytes(BT, KVT)
STAGING = 64_000
W = 400_000  # weights of each model


def _sched(stripe=(1, 2), budgets=(1_000_000,) * 3, **kw):
    s = Scheduler(SchedulerConfig(budgets=budgets, block_tokens=BT, stripe_devices=stripe, stripe_staging=STAGING,
                                  **kw))
    return s


def _ask(s, i, model):
    s.add_request(SchedRequest(f"r{i}", model, 4, 2, float(i)))


def test_a_load_borrows_the_idle_links_and_books_their_staging_until_it_ends():
    s = _sched()
    s.add_model("a", W, KVT, devices=(0,))
    _ask(s, 0, "a")
    plan = s.schedule(0.0)
    assert plan.loads == ["a"] and plan.stripes == {"a": (1, 2)}
    assert s.lent == {1: "a", 2: "a"}
    # the helpers' budgets carry the staging, the model's device its weights (and its request's block)
    assert [s.free_bytes(d) for d in (1, 2)] == [1_000_000 - STAGING] * 2
    assert s.free_bytes(0) == 1_000_000 - W - BLOCK
    s.update(plan)
    s.loaded("a")  # the executor reports the copies done: links and staging come back
    assert s.lent == {} and s.staging_used == [0, 0, 0]
    assert [s.free_bytes(d) for d in (1, 2)] == [1_000_000] * 2


def test_a_busy_link_is_not_lent_and_a_device_helps_one_load_at_a_time():
    s = _sched(stripe=(0, 1, 2), budgets=(1_000_000,) * 4)
    for name, dev in (("a", 0), ("b", 1), ("c", 3), ("d", 2)):
        s.add_model(name, W, KVT, devices=(dev,))
    # b (device 1) loads first, alone: devices 0 and 2 lend it their links
    _ask(s, 0, "b")
    plan = s.schedule(0.0)
    assert plan.stripes == {"b": (0, 2)}
    s.update(plan)
    # while b's load is in flight, a on device 0 and c on device 3 load: device 1 has a load of its
    # own in flight, 0 and 2 are lent to it: nothing is lent
    _ask(s, 1, "a")
    _ask(s, 2, "c")
    plan = s.schedule(1.0)
    assert set(plan.loads) == {"a", "c"} and plan.stripes == {}
    s.update(plan)
    s.loaded("b")  # b's links come back; a and c still load: 0 has a load in flight, 1 and 2 are idle
    _ask(s, 3, "d")
    s.loaded("a")
    plan = s.schedule(2.0)
    assert plan.loads == ["d"] and plan.stripes == {"d": (0, 1)}  # 2 is d's own device
    assert s.staging_used == [STAGING, STAGING, 0, 0]


def test_staging_needs_room_on_the_helper_and_an_undone_load_returns_it():
    s = _sched(budgets=(1_000_000, 1_000_000, 420_000))
    s.add_model("a", W, KVT, devices=(0,))
    s.add_model("full", W, KVT, devices=(2,))
    s.add_model("b", W, KVT, devices=(1,))
    _ask(s, 0, "full")
    plan = s.schedule(0.0)
    assert plan.stripes == {"full": (1,)}  # its own device is not its helper
    s.update(plan)
    s.finish("r0")
    s.loaded("full")
    plan = s.plan_load("a", 1.0)  # an admin load plans the same lending
    assert plan.stripes == {"a": (1,)}  # device 2 holds 'full': no room left there for the staging
    s.offloaded("a")  # the load failed (or an admin offload): the links come back with it
    assert s.lent == {} and s.staging_used == [0, 0, 0]
    assert s.free_bytes(1) == 1_000_000


def test_sharded_models_are_not_striped_and_bad_stripe_devices_are_refused():
    s = _sched(budgets=(1_000_000,) * 4, stripe=(2, 3))
    s.add_model("tp", (W // 2, W // 2), (KVT // 2, KVT // 2), devices=(0, 1))
    _ask(s, 0, "tp")
    plan = s.schedule(0.0)
    assert plan.loads == ["tp"] and plan.stripes == {} and s.staging_used == [0] * 4
    with pytest.raises(ValueError, match=r"stripe_devices \[3\]: a helper must be one of the 3 devices"):
        _sched(stripe=(1, 3))
    with pytest.raises(ValueError, match="stripe_staging must be at least 1 byte"):
        Scheduler(SchedulerConfig(budgets=(1, 1), stripe_devices=(1,)))
    plain = Scheduler(SchedulerConfig(budgets=(1_000_000,) * 2, block_tokens=BT))
    plain.add_model("a", W, KVT, devices=(0,))
    _ask(plain, 0, "a")
    assert plain.schedule(0.0).stripes == {}  # no stripe devices: nothing is ever lent


def test_the_slo_policy_times_a_load_by_the_links_it_was_lent():
    from computron.scheduler import ModelCost, SchedRequest
    from computron.sim.costs import Calibration

    # 1 GB/s links: a model on device 0 loads through its own link, then with one and two helpers; its own
    # device among the stripe devices is not its helper
    one, two, three = W / 1e9, W / 2e9, W / 3e9
    cal = Calibration(name="t", swap_bandwidth=(1e9,) * 3)
    cost = {d: ModelCost.from_calibration(cal, (W,), (d,), stripe=(1, 2)) for d in (0, 1)}
    assert cost[0].load_links_s == pytest.approx((one, two, three), rel=1e-3)
    assert cost[1].load_links_s == pytest.approx((one, two), rel=1e-3)  # device 1 is b's own
    assert [cost[0].load(k) for k in (0, 1, 2, 5, None)] == pytest.approx([one, two, three, three, three], rel=1e-3)
    s = _sched(policy="slo")
    for name, dev in (("a", 0), ("b", 1), ("c", 0)):
        s.add_model(name, W, KVT, devices=(dev,), cost=cost[dev])
    # an offloaded model's next load is priced with the links idle now: both helpers
    assert s.slo.load_s(s.models["a"]) == pytest.approx(three, rel=1e-3)
    _ask(s, 0, "b")
    plan = s.schedule(0.0)
    assert plan.stripes == {"b": (2,)}
    assert s.models["b"].ready_at == pytest.approx(two, rel=1e-3)  # its own link and device 2's
    s.update(plan)
    # while b loads, device 1 has a load in flight and device 2 is lent: a loads alone, and is due so
    assert s.slo.load_s(s.models["a"]) == pytest.approx(one, rel=1e-3)
    _ask(s, 5, "a")
    plan = s.schedule(1.0)
    assert plan.loads == ["a"] and plan.stripes == {}
    assert s.models["a"].ready_at - 1.0 == pytest.approx(one, rel=1e-3)
    s.update(plan)
    s.loaded("b")
    assert s.slo.load_s(s.models["c"]) == pytest.approx(three, rel=1e-3)
    # a stopped request's cache moves over its model's own link, whatever links its loads borrow
    held = SchedRequest("held", "a", 4, 3, 0.0)
    held.blocks = 3
    assert s.models["a"].block_bytes == (BLOCK,)
    moved = s.slo.move_s(s.models["a"], held)
    assert moved == pytest.approx(2 * 3 * BLOCK / 1e9, rel=1e-3)
    # device 2 has no room for the staging it would lend: a load on device 0 gets device 1's link alone
    s = _sched(policy="slo", budgets=(1_000_000, 1_000_000, STAGING - 1))
    s.add_model("a", W, KVT, devices=(0,), cost=cost[0])
    assert s.slo.load_s(s.models["a"]) == pytest.approx(two, rel=1e-3)
    _ask(s, 0, "a")
    plan = s.schedule(0.0)
    assert plan.stripes == {"a": (1,)} and s.models["a"].ready_at == pytest.approx(two, rel=1e-3)
