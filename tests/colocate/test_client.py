"""The training side's run-ahead bound and abandon points, on the CPU with scripted fences.

A CPU tensor's work is done when its call returns, so these tests hand ``Colocation`` a fence
factory that stands in for CUDA events and record when the host waits on each.
"""

import gc
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from computron.colocate.client import Abandoned, Colocation, cuda_fence
from computron.colocate.memmodel import MemoryModel


class Fences:
    """Fence factory: numbers the fences in creation order and logs each wait as (fence, fences made by then)."""

    def __init__(self, on_make=None):
        self.made, self.waits, self.on_make = 0, [], on_make

    def __call__(self, t):
        i = self.made
        self.made += 1
        if self.on_make is not None:
            self.on_make(i)
        fences = self

        class Event:
            def synchronize(self):
                fences.waits.append((i, fences.made))

        return Event()


def net(width=8, depth=5):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def micro_batch(model, colo, x):
    with colo.step(x.shape[0]) as s:
        loss = model(x).square().sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return s, (None if s.abandoned else grads)


@pytest.mark.parametrize("run_ahead", [1, 3, 8])
def test_the_host_waits_for_the_fence_run_ahead_points_back(run_ahead):
    fences = Fences()
    model, colo = net(), Colocation(run_ahead=run_ahead, fence=fences)
    colo.watch(model)
    s, _ = micro_batch(model, colo, torch.randn(4, 8))
    assert not s.abandoned
    assert fences.made == 10  # 5 watched Linears: one point in the forward, one in the backward each
    # fence i is waited for as soon as fence i + run_ahead exists, never later: at most run_ahead outstanding
    assert fences.waits == [(i, i + run_ahead + 1) for i in range(fences.made - run_ahead)]


@pytest.mark.parametrize("run_ahead,every", [(4, 2), (8, 4), (6, 4)])
def test_spaced_fences_keep_the_bound_in_points(run_ahead, every):
    fences = Fences()
    model, colo = net(depth=12), Colocation(run_ahead=run_ahead, fence=fences, fence_every=every)
    colo.watch(model)
    micro_batch(model, colo, torch.randn(4, 8))
    points = 24  # 12 Linears, a forward and a backward point each
    assert fences.made == points // every
    # fence i lies at point (i + 1) * every; it is waited for at the first fence at least run_ahead points later
    at = [(i + 1) * every for i in range(fences.made)]
    later = [next((j for j, n in enumerate(at) if n >= p + run_ahead), None) for p in at]
    assert fences.waits == sorted(((i, j + 1) for i, j in enumerate(later) if j is not None), key=lambda w: w[1])
    assert all(at[made - 1] - at[i] < run_ahead + every for i, made in fences.waits)  # the queue stays bounded
    with pytest.raises(ValueError, match="fence_every must be from 1 to run_ahead"):
        Colocation(run_ahead=2, fence_every=3)


def test_no_bound_records_no_fences_and_a_negative_bound_is_refused():
    fences = Fences()
    model, colo = net(), Colocation(run_ahead=0, fence=fences)
    colo.watch(model)
    micro_batch(model, colo, torch.randn(4, 8))
    assert fences.made == 0
    with pytest.raises(ValueError, match="run_ahead must be >= 0"):
        Colocation(run_ahead=-1)


@pytest.mark.parametrize("at", [2, 7])  # a forward point, a backward point
def test_an_order_arriving_while_the_host_waits_abandons_at_that_point(at):
    kept = []
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), run_ahead=2, release=kept.append)
    limit = {"t": "limit", "id": 1, "bytes": 125, "immediate": True}  # fits 2 samples, not 4
    fences = Fences(on_make=lambda i: colo.deliver(limit) if i == at else None)
    colo.fence = fences
    model = net()
    colo.watch(model)
    assert colo.micro_batch(most=4) == 4
    s, grads = micro_batch(model, colo, torch.randn(4, 8))
    assert s.abandoned and grads is None and colo.abandoned == 1
    assert fences.made == at + 1  # nothing was queued past the point where the order was seen
    colo._chan = Sent()
    waited = len(fences.waits)
    assert colo.micro_batch(most=4) == 2  # redone at the size that fits
    # before the release, the host waited for the newest fence: the work the abandoned micro-batch queued
    assert fences.waits[waited:] == [(at, at + 1)]
    assert kept == [125]  # released down to the limit, not to nothing
    (ack,) = colo._chan.msgs
    assert ack["t"] == "ack" and ack["id"] == 1 and ack["bytes"] == 125
    assert ack["received"] <= ack["reached"] <= ack["drained"] <= ack["released"]
    assert ack["at"] == "running"  # the order came while the micro-batch ran (not at a fence's wait)
    s, grads = micro_batch(model, colo, torch.randn(2, 8))
    assert not s.abandoned and len(grads) == 10


def run_in_thread(fn):
    out, done = {}, threading.Event()

    def body():
        out["result"] = fn()
        done.set()

    threading.Thread(target=body, daemon=True).start()
    return out, done


def test_a_yield_holds_the_host_at_the_next_point_until_it_ends():
    x = torch.randn(4, 8)
    reference = micro_batch(net(), Colocation(run_ahead=1, fence=Fences()), x)[1]
    fences = Fences()
    model, colo = net(), Colocation(run_ahead=1, fence=fences)
    colo.watch(model)
    colo.deliver({"t": "yield", "on": True})
    out, done = run_in_thread(lambda: micro_batch(model, colo, x))
    assert not done.wait(0.3)  # held at the first Linear's point: nothing queued past it
    assert fences.made == 1
    colo.deliver({"t": "yield", "on": False})
    assert done.wait(5.0)
    s, grads = out["result"]
    assert not s.abandoned and fences.made == 10 and colo.yielded_s >= 0.3
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))  # the same micro-batch, only later


def test_an_abandon_order_ends_a_yield_and_abandons_there():
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), run_ahead=2, fence=Fences())
    model = net()
    colo.watch(model)
    assert colo.micro_batch(most=4) == 4
    colo.deliver({"t": "yield", "on": True})
    out, done = run_in_thread(lambda: micro_batch(model, colo, torch.randn(4, 8)))
    assert not done.wait(0.2)
    colo.deliver({"t": "limit", "id": 1, "bytes": 125, "immediate": True})  # 4 samples no longer fit
    assert done.wait(5.0)
    s, grads = out["result"]
    assert s.abandoned and grads is None and colo.fence.made == 1


class KeepsItsError(nn.Module):
    """A layer whose frame keeps the exception passing through it: the reference cycle (exception,
    traceback, frame) that only the garbage collector breaks, holding the activation ``y``."""

    def __init__(self, inner):
        super().__init__()
        self.lin, self.inner, self.seen = nn.Linear(8, 8), inner, []

    def forward(self, x):
        y = self.lin(x)
        self.seen.append(weakref.ref(y))
        try:
            return self.inner(y)
        except Abandoned:
            kept = sys.exc_info()  # noqa: F841 (the cycle)
            raise


def test_an_abandoned_micro_batch_lets_go_of_what_its_frames_held_without_the_garbage_collector():
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), run_ahead=2)
    limit = {"t": "limit", "id": 1, "bytes": 125, "immediate": True}
    colo.fence = Fences(on_make=lambda i: colo.deliver(limit) if i == 3 else None)  # in the forward
    model = KeepsItsError(net())
    colo.watch(model)
    gc.disable()
    try:
        assert colo.micro_batch(most=4) == 4
        s, _ = micro_batch(model, colo, torch.randn(4, 8))
        assert s.abandoned
        assert model.seen[0]() is None  # the activation went with the step, not at the next collection
    finally:
        gc.enable()


def test_the_cuda_fence_is_none_for_cpu_tensors():
    assert cuda_fence(torch.zeros(1)) is None


def test_a_closed_server_takes_no_connection_and_the_job_finds_the_next_one(tmp_path):
    from computron.colocate.arbiter import Arbiter, ArbiterConfig
    from computron.colocate.protocol import ArbiterServer

    addr = str(tmp_path / "arbiter.sock")
    first = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000)), addr)
    colo = Colocation(addr, reconnect_s=0.01)
    try:
        assert colo.wait_connected(5.0) and first.trainer_connected(0)
        first.close()
        time.sleep(0.3)  # the job tries to reconnect meanwhile: the closed server must not answer
        assert not first.trainer_connected(0)
        second = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000)), addr)
        deadline = time.monotonic() + 5.0
        while not second.trainer_connected(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second.trainer_connected(0)
        second.close()
    finally:
        colo.close()


class Sent:
    """A channel that keeps what the job sends."""

    def __init__(self):
        self.msgs = []

    def send(self, msg):
        self.msgs.append(msg)


def test_an_ack_tells_when_the_loop_reached_the_release_and_when_it_ended():
    """An order for memory the job holds is acknowledged at its next micro-batch: ``reached`` is when
    the loop got there (here 50 ms after the order), ``released`` when the release (30 ms) ended; an
    order for memory already free is acknowledged at once, reached as received."""
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), release=lambda keep: time.sleep(0.03))
    colo._chan = Sent()
    assert colo.micro_batch(most=4) == 4  # committed: 100 + 4 * 10 bytes
    colo.deliver({"t": "limit", "id": 1, "bytes": 125, "immediate": False})
    assert colo._chan.msgs == []  # the memory is still held: acknowledged once released
    time.sleep(0.05)
    assert colo.micro_batch(most=4) == 2
    (ack,) = colo._chan.msgs
    assert ack["id"] == 1 and ack["received"] + 0.05 <= ack["reached"] <= ack["released"] - 0.03
    colo.deliver({"t": "limit", "id": 2, "bytes": 10_000, "immediate": False})
    assert colo._chan.msgs[-1]["id"] == 2 and colo._chan.msgs[-1]["reached"] == colo._chan.msgs[-1]["received"]


def test_the_most_told_has_slack_so_a_cap_there_survives_the_predictions_small_moves():
    """The job tells its largest micro-batch's prediction and MOST_SLACK of it; a cap at that keeps it
    at its largest size while later measurements move the prediction within the slack, and it tells
    again only when the prediction leaves the band below what it told."""
    from computron.colocate.client import MOST_SLACK

    memory = MemoryModel(1_000_000, 10_000, rel_margin=0.0)
    colo = Colocation(memory=memory)
    colo._chan = Sent()
    memory.record(16, 10_000_000)
    assert colo.micro_batch(most=16) == 16
    told = colo._chan.msgs[-1]
    need = memory.predict(16)
    assert told == {"t": "most", "bytes": need + int(need * MOST_SLACK)}
    colo.deliver({"t": "limit", "id": 1, "bytes": told["bytes"], "immediate": False})  # colocate's cap
    memory.record(16, 10_030_000)  # a later micro-batch of 16 peaked 30 kB (0.3%) higher
    assert memory.predict(16) > need and colo.micro_batch(most=16) == 16  # still fits the cap
    assert colo._chan.msgs[-1] is not told and colo._chan.msgs[-1]["t"] == "ack"  # nothing told again
    memory.record(16, 10_100_000)  # 1% higher: past the slack, told again (the cap is the old one)
    assert colo.micro_batch(most=16) < 16
    mosts = [m for m in colo._chan.msgs if m["t"] == "most"]
    assert mosts[1:] == [{"t": "most", "bytes": memory.predict(16) + int(memory.predict(16) * MOST_SLACK)}]


def test_the_job_tells_the_server_the_most_it_can_use_and_colocate_caps_it_there(tmp_path):
    """Once the job measured a size, it says what its largest micro-batch would take (the memory model's
    prediction): the server caps training's limit there and idle inference gets the rest; a job that
    reconnects says it again in its hello."""
    from computron.colocate.arbiter import Arbiter, ArbiterConfig
    from computron.colocate.protocol import ArbiterServer

    addr = str(tmp_path / "arbiter.sock")
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000, idle_s=0.0)), addr)
    memory = MemoryModel(100, 10, rel_margin=0.0)
    colo = Colocation(addr, memory=memory, reconnect_s=0.01)

    def wait(cond):
        deadline = time.monotonic() + 5.0
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.005)
        return cond()

    try:
        assert colo.wait_connected(5.0) and colo.limit == 1000  # nothing measured: the whole device
        assert colo.micro_batch(most=8) == 8 and server.arbiter.devices[0].train_max == 0  # nothing said yet
        memory.record(8, 190)  # a micro-batch of 8 peaked at 190 bytes: 8 takes 190, the most it can use
        assert colo.micro_batch(most=8) == 8
        assert wait(lambda: colo.limit == 190)
        assert wait(lambda: server.records()["shares"][0] == [810, 190])  # idle inference has the rest
        assert server.records()["settled"] == [True]
        assert [r[1:] for r in server.records()["mosts"]] == [[0, 0], [0, 190]]  # the hello's unknown, then 190
        server.close()
        again = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000, idle_s=0.0)), addr)
        try:
            assert wait(lambda: again.trainer_connected(0)) and wait(lambda: colo.limit == 190)
            assert again.arbiter.devices[0].train_max == 190
            assert [r[1:] for r in again.records()["mosts"]] == [[0, 190]]  # said again in the hello
        finally:
            again.close()
    finally:
        colo.close()


def test_a_job_that_sends_what_the_arbiter_cannot_take_is_dropped_and_its_device_freed(tmp_path, caplog):
    """A malformed hello is refused with its reason; a malformed message later drops the job (its share
    freed, a warning saying which message) instead of leaving its device taken for good."""
    import json
    import socket

    from computron.colocate.arbiter import Arbiter, ArbiterConfig
    from computron.colocate.protocol import ArbiterServer

    addr = str(tmp_path / "arbiter.sock")
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000)), addr)

    def job(*msgs):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5.0)  # a server that never answers fails the test, not hangs it
        s.connect(addr)
        for m in msgs:
            s.sendall((json.dumps(m) + "\n").encode())
        return s, s.makefile("r")

    try:
        s, f = job({"t": "hello", "device": "zero"})
        assert "whole numbers" in json.loads(f.readline())["error"] and f.readline() == ""
        s.close()
        s, f = job({"t": "hello", "device": 0, "min_bytes": 10}, {"t": "most", "bytes": -5})
        assert json.loads(f.readline())["t"] == "limit"  # joined
        assert f.readline() == ""  # then dropped for the negative most
        s.close()
        deadline = time.monotonic() + 5.0
        while server.trainer_connected(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.trainer_connected(0) and server.arbiter.shares(0) == (0, 0)
        assert any("cannot take" in r.message and "-5" in r.message for r in caplog.records)
        colo = Colocation(addr, reconnect_s=0.01)  # the device is free for the next job
        try:
            assert colo.wait_connected(5.0) and colo.limit == 1000
        finally:
            colo.close()
    finally:
        server.close()


def test_an_order_after_the_size_was_chosen_waits_for_the_micro_batch_which_it_abandons():
    """Once ``micro_batch`` chose a size the loop is about to run it: an order that size exceeds abandons the
    micro-batch at its start, and the loop's next call releases and acknowledges (``at``: chosen)."""
    kept = []
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), release=kept.append)
    colo._chan = Sent()
    model = net()
    colo.watch(model)
    assert colo.micro_batch(most=4) == 4
    colo.deliver({"t": "limit", "id": 1, "bytes": 125, "immediate": True})
    assert kept == [] and colo._chan.msgs == []
    s, _ = micro_batch(model, colo, torch.randn(4, 8))
    assert s.abandoned
    assert colo.micro_batch(most=4) == 2 and kept == [125] and [m["id"] for m in colo._chan.msgs] == [1]
    assert colo._chan.msgs[0]["at"] == "chosen"


def test_an_order_no_micro_batch_fits_waits_for_the_loop_which_pauses():
    """Between micro-batches, an order under the smallest micro-batch waits for the loop, which pauses (moves
    the state off the device), releases everything and acknowledges (``at``: between)."""
    paused, kept = [], []
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), release=kept.append,
                      on_pause=lambda: paused.append(True))
    colo._chan = Sent()
    assert colo.micro_batch(most=4) == 4
    micro_batch(net(), colo, torch.randn(4, 8))
    colo.deliver({"t": "limit", "id": 1, "bytes": 105, "immediate": True})  # under 100 + 1 * 10
    assert kept == [] and colo._chan.msgs == []
    out, done = run_in_thread(lambda: colo.micro_batch(most=4))
    deadline = time.monotonic() + 5
    while not paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert paused == [True] and kept == [0] and [m["id"] for m in colo._chan.msgs] == [1]
    assert colo._chan.msgs[0]["at"] == "between"
    colo.deliver({"t": "limit", "id": 2, "bytes": 1000, "immediate": True})
    assert done.wait(5.0) and out["result"] == 4


def test_an_order_that_finds_the_host_waiting_at_a_fence_says_so():
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), run_ahead=1)
    colo._chan = Sent()

    class Fence:
        def synchronize(self):  # the order comes while the host waits here
            if not colo._chan.msgs and colo._limit is None:
                colo.deliver({"t": "limit", "id": 1, "bytes": 125, "immediate": True})

    colo.fence = lambda t: Fence()
    model = net()
    colo.watch(model)
    assert colo.micro_batch(most=4) == 4
    s, _ = micro_batch(model, colo, torch.randn(4, 8))
    assert s.abandoned
    assert colo.micro_batch(most=4) == 2 and colo._chan.msgs[-1]["at"] == "fence"
