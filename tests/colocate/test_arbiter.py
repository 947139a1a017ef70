"""The arbiter's decisions on scripted demand: never over budget, inference never starved, hysteresis."""

import random

import pytest

from computron.colocate.arbiter import YIELD_STALE_S, Arbiter, ArbiterConfig, InferenceShare, TrainLimit, TrainYield

GB = 1 << 30


class Script:
    """Drives an arbiter like the real sides do: training acks each limit, inference confirms reductions."""

    def __init__(self, arb: Arbiter, ack_delay: float = 0.01):
        self.arb, self.ack_delay = arb, ack_delay
        self.train_limit, self.infer_budget = None, 0
        self.pending_acks: list[tuple[float, TrainLimit]] = []
        self.messages: list[tuple[float, object]] = []

    def apply(self, actions, now):
        for a in actions:
            self.messages.append((now, a))
            if isinstance(a, TrainLimit):
                self.pending_acks.append((now + self.ack_delay, a))
            else:
                reduce = a.bytes < self.infer_budget
                self.infer_budget = a.bytes
                if reduce:
                    self.apply(self.arb.inference_released(a.device, now), now)
        self.check()

    def run_until(self, now):
        while self.pending_acks and self.pending_acks[0][0] <= now:
            t, lim = self.pending_acks.pop(0)
            self.train_limit = lim.bytes
            self.apply(self.arb.train_ack(lim.device, lim.id, lim.bytes, t), t)
        self.apply(self.arb.tick(now), now)

    def check(self):
        if self.arb.config.mode == "normal":
            return
        infer, train = self.arb.shares(0)
        assert infer + train <= self.arb.config.capacity, (infer, train)
        # what each side was told never exceeds what is booked for it
        assert self.infer_budget <= infer
        if self.train_limit is not None and not self.arb.pending(0):
            assert self.train_limit <= train or self.train_limit == 0


def scripted(mode, seed, **kw):
    rng = random.Random(seed)
    cfg = ArbiterConfig(mode=mode, capacity=40 * GB, idle_s=0.5, static_train=16 * GB, **kw)
    arb = Arbiter(cfg)
    s = Script(arb)
    s.apply(arb.train_joined(0, 4 * GB, 0.0), 0.0)
    now, waits = 0.0, []
    for _ in range(400):
        now += rng.expovariate(20.0) if rng.random() < 0.9 else rng.uniform(0.5, 2.0)  # bursts and idle gaps
        s.run_until(now)
        want = rng.choice([0, 3, 6, 12, 30]) * GB
        s.apply(arb.demand(0, want, now), now)
        waits.append((now, want))
        s.run_until(now + 0.02)  # one ack later
        if mode in ("colocate", "task-switch"):
            assert s.infer_budget >= want, f"inference starved: wants {want}, has {s.infer_budget}"
        elif mode == "static":
            assert s.infer_budget == min(want, cfg.capacity - cfg.static_train) or s.infer_budget > want
    return s


@pytest.mark.parametrize("mode", ["static", "task-switch", "colocate", "normal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scripted_demand_never_over_budget_and_never_starved(mode, seed):
    s = scripted(mode, seed)
    limits = [a.bytes for _, a in s.messages if isinstance(a, TrainLimit)]
    if mode == "colocate":  # training keeps running with a smaller share, and is not only paused
        assert any(0 < b < 40 * GB for b in limits)
        shrunk = next(i for i, b in enumerate(limits) if b < 40 * GB)
        assert 40 * GB in limits[shrunk:]  # and gets the whole device back after idle gaps
    if mode == "task-switch":
        assert set(limits[1:]) <= {0} | {b for b in limits if b >= 4 * GB} and 0 in limits
    if mode == "static":
        assert limits == [16 * GB]
    if mode == "normal":
        assert limits == [40 * GB]


def test_colocate_frees_exactly_what_inference_needs():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=40 * GB, idle_s=1.0))
    [lim] = arb.train_joined(0, 2 * GB, 0.0)
    assert lim.bytes == 40 * GB
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    [shrink] = arb.demand(0, 3 * GB, 1.0)
    assert shrink == TrainLimit(0, 37 * GB, True, shrink.id)
    assert arb.shares(0) == (0, 40 * GB)  # nothing granted before training acknowledges
    assert arb.demand(0, 3 * GB, 1.001) == []  # a repeated demand sends nothing new
    assert arb.train_ack(0, shrink.id, 37 * GB, 1.002) == [InferenceShare(0, 3 * GB)]
    assert arb.shares(0) == (3 * GB, 37 * GB)
    # a demand leaving training less than its minimum pauses it
    [pause] = arb.demand(0, 39 * GB, 1.1)
    assert pause.bytes == 0
    assert arb.train_ack(0, pause.id, 0, 1.2) == [InferenceShare(0, 39 * GB)]


def test_hysteresis_memory_goes_back_only_after_idle():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=10 * GB, idle_s=2.0, infer_floor=1 * GB))
    lim = arb.train_joined(0, 1 * GB, 0.0)[0]
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    shrink = arb.demand(0, 6 * GB, 5.0)[0]
    arb.train_ack(0, shrink.id, shrink.bytes, 5.01)
    arb.busy(0, 6.0)
    assert arb.tick(7.9) == []  # 1.9 s idle: nothing moves
    assert arb.tick(8.0) == [InferenceShare(0, 1 * GB)]  # 2 s idle: inference shrinks first
    assert arb.shares(0) == (6 * GB, 4 * GB)  # ... and still holds its bytes until it confirms
    assert arb.tick(8.5) == []
    [grow] = arb.inference_released(0, 8.6)
    assert grow.bytes == 9 * GB and arb.shares(0) == (1 * GB, 9 * GB)


def test_new_work_cancels_an_unconfirmed_idle_reduction():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=10 * GB, idle_s=1.0))
    lim = arb.train_joined(0, 1 * GB, 0.0)[0]
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    arb.train_ack(0, arb.demand(0, 4 * GB, 1.0)[0].id, 6 * GB, 1.0)
    assert arb.tick(2.5) == [InferenceShare(0, 0)]
    # work again before the engine shrank: it is told it keeps its share (it was told 0)
    assert arb.demand(0, 4 * GB, 2.6) == [InferenceShare(0, 4 * GB)]
    assert arb.inference_released(0, 2.7) == [] and arb.shares(0) == (4 * GB, 6 * GB)


def test_task_switch_pauses_training_and_gives_inference_the_device():
    arb = Arbiter(ArbiterConfig(mode="task-switch", capacity=10 * GB, idle_s=1.0))
    lim = arb.train_joined(0, 1 * GB, 0.0)[0]
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    [pause] = arb.demand(0, 1 * GB, 1.0)
    assert pause.bytes == 0
    assert arb.train_ack(0, pause.id, 0, 1.01) == [InferenceShare(0, 10 * GB)]
    assert arb.demand(0, 3 * GB, 1.5) == []
    assert arb.tick(2.6) == [InferenceShare(0, 0)]
    assert arb.inference_released(0, 2.7)[0].bytes == 10 * GB


def test_static_split_is_fixed():
    arb = Arbiter(ArbiterConfig(mode="static", capacity=10 * GB, static_train=6 * GB))
    assert arb.demand(0, 8 * GB, 0.0) == [InferenceShare(0, 4 * GB)]
    assert arb.train_joined(0, 1 * GB, 0.1)[0].bytes == 6 * GB
    assert arb.tick(100.0) == [] and arb.shares(0) == (4 * GB, 6 * GB)


def test_training_death_frees_its_share_for_a_waiting_demand():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=10 * GB))
    lim = arb.train_joined(0, 1 * GB, 0.0)[0]
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    assert isinstance(arb.demand(0, 5 * GB, 1.0)[0], TrainLimit)
    assert arb.train_left(0, 1.1) == [InferenceShare(0, 5 * GB)]
    assert arb.train_ack(0, lim.id, 0, 1.2) == []  # a late ack from the dead job changes nothing


def test_config_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown colocation mode 'share'"):
        ArbiterConfig(mode="share", capacity=1)
    with pytest.raises(ValueError, match="static_train must be within"):
        ArbiterConfig(mode="static", capacity=10, static_train=11)


def yields(actions):
    return [a for a in actions if isinstance(a, TrainYield)]


def test_training_yields_the_compute_while_inference_has_work_and_only_then():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=40 * GB, yield_compute="work"))
    assert arb.busy(0, 0.0) == []  # no job joined: nobody to tell
    arb.train_joined(0, GB, 0.0)
    assert arb.busy(0, 1.0) == [TrainYield(0, True)]
    assert arb.busy(0, 1.01) == [] and arb.busy(0, 1.011, first_token=False) == []  # told once; any work counts
    assert arb.quiet(0, 1.02) == [TrainYield(0, False)]
    assert arb.quiet(0, 1.03) == []
    # inference that stops reporting (a request cancelled between steps) does not hold training for good
    arb.busy(0, 2.0)
    assert yields(arb.tick(2.0 + YIELD_STALE_S / 2)) == []
    assert yields(arb.tick(2.0 + YIELD_STALE_S)) == [TrainYield(0, False)]
    # a job that reconnects runs until inference's next report
    arb.busy(0, 3.0)
    arb.train_joined(0, GB, 3.1)
    assert arb.quiet(0, 3.15) == [] and arb.busy(0, 3.2) == [TrainYield(0, True)]
    arb.train_left(0, 3.3)
    assert arb.quiet(0, 3.4) == []  # nobody left to tell


@pytest.mark.parametrize("policy", ["first-token", "cold"])
def test_first_token_yields_only_while_a_request_waits_for_its_first_token(policy):
    # under cold, the engine's link reports only the requests that found their model off the device
    arb = Arbiter(ArbiterConfig(mode="static", capacity=40 * GB, static_train=16 * GB, yield_compute=policy))
    arb.train_joined(0, GB, 0.0)
    assert arb.busy(0, 1.0, first_token=False) == []  # decode steps share the GPU
    assert arb.busy(0, 1.1, first_token=True) == [TrainYield(0, True)]
    assert arb.busy(0, 1.2, first_token=True) == []
    assert arb.busy(0, 1.3, first_token=False) == [TrainYield(0, False)]  # still busy, but only decoding
    assert arb.busy(0, 1.4, first_token=True) == [TrainYield(0, True)]
    assert arb.quiet(0, 1.5) == [TrainYield(0, False)]
    with pytest.raises(ValueError, match="unknown yield_compute 'always'; known: none, cold, first-token, work"):
        ArbiterConfig(mode="colocate", capacity=GB, yield_compute="always")


@pytest.mark.parametrize("mode, flag", [("colocate", "none"), ("static", "none"), ("normal", "work"),
                                        ("task-switch", "work")])
def test_no_yield_without_the_flag_or_in_modes_that_do_not_share_the_compute(mode, flag):
    arb = Arbiter(ArbiterConfig(mode=mode, capacity=40 * GB, static_train=16 * GB, yield_compute=flag))
    arb.train_joined(0, GB, 0.0)
    assert arb.busy(0, 1.0) == [] and arb.quiet(0, 1.1) == [] and yields(arb.tick(5.0)) == []


def test_colocate_gives_training_no_more_than_it_can_use_and_idle_inference_keeps_the_rest():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=24 * GB, idle_s=1.0))
    [lim] = arb.train_joined(0, 2 * GB, 0.0, max_bytes=16 * GB)
    assert lim.bytes == 16 * GB
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    # the 8 GB training cannot use are idle inference's: its models need not be evicted for them
    assert not arb.settled(0)
    assert arb.tick(1.0) == [InferenceShare(0, 8 * GB)] and arb.settled(0)
    assert arb.demand(0, 6 * GB, 2.0) == []  # work that fits there takes no handover
    [shrink] = arb.demand(0, 11 * GB, 2.1)  # more than that shrinks training by the difference
    assert shrink.bytes == 13 * GB
    assert arb.train_ack(0, shrink.id, 13 * GB, 2.2) == [InferenceShare(0, 11 * GB)]
    assert arb.tick(3.0) == []  # 0.9 s idle
    assert arb.tick(3.2) == [InferenceShare(0, 8 * GB)]  # idle: back only what training can use
    [grow] = arb.inference_released(0, 3.3)
    assert grow.bytes == 16 * GB and arb.shares(0) == (8 * GB, 16 * GB) and not arb.settled(0)
    arb.train_ack(0, grow.id, grow.bytes, 3.4)
    assert arb.settled(0)


def test_a_job_that_learns_the_most_it_can_use_is_capped_there_and_other_modes_ignore_it():
    arb = Arbiter(ArbiterConfig(mode="colocate", capacity=24 * GB, idle_s=1.0))
    [lim] = arb.train_joined(0, 2 * GB, 0.0)  # nothing measured yet: the whole device
    assert lim.bytes == 24 * GB
    arb.train_ack(0, lim.id, lim.bytes, 0.0)
    [down] = arb.train_most(0, 16 * GB, 0.5)  # it uses 16: its limit comes down, nothing to free
    assert down.bytes == 16 * GB
    assert arb.train_ack(0, down.id, 16 * GB, 0.5) == []
    assert arb.tick(1.0) == [InferenceShare(0, 8 * GB)]
    assert arb.train_most(0, 16 * GB, 1.1) == []  # unchanged: nothing sent
    # a larger most grows training into free memory only: idle inference keeps what it holds until the
    # next idle tick gives it back
    assert arb.train_most(0, 20 * GB, 1.2) == []
    assert arb.tick(2.0) == [InferenceShare(0, 4 * GB)]
    [grow] = arb.inference_released(0, 2.1)
    assert grow.bytes == 20 * GB
    for mode in ("task-switch", "static", "normal"):
        other = Arbiter(ArbiterConfig(mode=mode, capacity=24 * GB, idle_s=1.0, static_train=10 * GB))
        [lim] = other.train_joined(0, 2 * GB, 0.0, max_bytes=16 * GB)
        assert lim.bytes == {"static": 10 * GB}.get(mode, 24 * GB)
        other.train_ack(0, lim.id, lim.bytes, 0.0)
        assert other.train_most(0, 12 * GB, 0.5) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scripted_demand_with_a_capped_job_never_over_budget_and_never_starved(seed):
    s2 = Script(Arbiter(ArbiterConfig(mode="colocate", capacity=40 * GB, idle_s=0.5)))
    rng = random.Random(seed)
    arb = s2.arb
    s2.apply(arb.train_joined(0, 4 * GB, 0.0, max_bytes=20 * GB), 0.0)
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(20.0) if rng.random() < 0.9 else rng.uniform(0.5, 2.0)
        s2.run_until(now)
        if rng.random() < 0.05:
            s2.apply(arb.train_most(0, rng.choice([10, 20, 30]) * GB, now), now)
        want = rng.choice([0, 3, 6, 12, 30]) * GB
        s2.apply(arb.demand(0, want, now), now)
        s2.run_until(now + 0.02)
        assert s2.infer_budget >= want, f"inference starved: wants {want}, has {s2.infer_budget}"
        # once nothing is in flight, training's limit is within the most it said it can use
        assert s2.train_limit is None or s2.train_limit <= arb.devices[0].train_max or arb.pending(0)
