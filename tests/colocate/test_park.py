"""Pausing through pinned host buffers (``colocate/park.py``) and orders delivered while the state moves."""

import threading
import time

import torch
from torch import nn

from computron.colocate.client import Colocation
from computron.colocate.memmodel import MemoryModel
from computron.colocate.park import Parking, training_slots


def trained_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 6)).square().sum().backward()
    opt.step()
    model(torch.randn(8, 6)).square().sum().backward()  # gradients present while paused
    return model, opt


def snapshot(model, opt):
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [p.grad.clone() for p in model.parameters()]
    out += [v.clone() for st in opt.state.values() for k, v in st.items() if k != "step"]
    return out


def test_park_points_every_tensor_at_a_reused_host_buffer_and_unpark_restores_it():
    model, opt = trained_pair()
    before = snapshot(model, opt)
    parking = Parking(lambda: training_slots(model.parameters(), opt, model.buffers()), "cpu")
    n = len(training_slots(model.parameters(), opt, model.buffers()))
    assert n == 6 * 4 + 3  # 6 parameters x (data, grad, two moments); BatchNorm's 3 buffers
    first = parking.park()
    assert parking.parked and first == sum(t.numel() * t.element_size() for t in before)
    w = model[0].weight
    assert w.data.data_ptr() == parking._host[(id(w), "data")].data_ptr()  # the slot now is the buffer
    assert parking.park() == 0  # already parked: nothing moves twice
    assert parking.unpark()
    assert not parking.parked and w.data.data_ptr() != parking._host[(id(w), "data")].data_ptr()
    for a, b in zip(before, snapshot(model, opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    buffers = {k: v.data_ptr() for k, v in parking._host.items()}
    parking.park()  # the second pause writes into the same host buffers
    assert {k: v.data_ptr() for k, v in parking._host.items()} == buffers


def test_reserved_host_buffers_are_the_ones_a_pause_fills():
    model, opt = trained_pair()
    before = snapshot(model, opt)
    parking = Parking(lambda: training_slots(model.parameters(), opt, model.buffers()), "cpu")
    size = sum(t.numel() * t.element_size() for t in before)
    assert parking.reserve() == size and parking.reserved_bytes == size
    w = model[0].weight
    assert not parking.parked and w.data.data_ptr() != parking._host[(id(w), "data")].data_ptr()  # nothing moved
    assert parking.reserve() == 0  # made once
    reserved = {k: v.data_ptr() for k, v in parking._host.items()}
    assert parking.park() == size
    assert {k: v.data_ptr() for k, v in parking._host.items()} == reserved  # the pause allocated nothing
    assert parking.unpark()
    for a, b in zip(before, snapshot(model, opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_pause_during_a_reserve_waits_for_it_and_uses_its_buffers():
    model, opt = trained_pair()
    gate, inside = threading.Event(), threading.Event()

    def slots():
        if not inside.is_set():  # the reserve's listing: hold it there until the pause is under way
            inside.set()
            gate.wait(5.0)
        return training_slots(model.parameters(), opt, model.buffers())

    parking = Parking(slots, "cpu")
    t = threading.Thread(target=parking.reserve)
    t.start()
    assert inside.wait(5.0)
    out = {}
    p = threading.Thread(target=lambda: out.setdefault("bytes", parking.park()))
    p.start()
    time.sleep(0.1)
    assert p.is_alive()  # waits for the reserve's lock
    gate.set()
    t.join(5.0)
    p.join(5.0)
    assert out["bytes"] == parking.reserved_bytes > 0 and parking.parked
    w = model[0].weight
    assert w.data.data_ptr() == parking._host[(id(w), "data")].data_ptr()


def test_a_stopped_unpark_leaves_the_state_whole_on_the_host_and_a_later_one_finishes():
    model, opt = trained_pair()
    before = snapshot(model, opt)
    parking = Parking(lambda: training_slots(model.parameters(), opt, model.buffers()), "cpu", chunk_bytes=64)
    parking.park()
    asked = []

    def stop():
        asked.append(1)
        return len(asked) == 2  # the order arrives after the second chunk

    assert not parking.unpark(stop)
    assert parking.parked and parking.stopped == 1 and len(asked) == 2
    host = parking._host[(id(model[0].weight), "data")]
    assert model[0].weight.data.data_ptr() == host.data_ptr()  # still the parked buffer
    assert parking.unpark()
    for a, b in zip(before, snapshot(model, opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Acks:
    def __init__(self):
        self.sent, self.at, self.other = [], [], []

    def send(self, msg):
        if msg["t"] != "ack":  # e.g. the most the job can use, once it measured a size
            self.other.append(msg)
            return
        self.sent.append(msg["id"])
        self.at.append(time.monotonic())


def test_an_order_is_acknowledged_while_a_resume_is_in_progress():
    """The resume holds no lock that delivery needs: an order the resumed job fits is answered at once."""
    started, finish = threading.Event(), threading.Event()

    def slow_resume():
        started.set()
        finish.wait(5.0)

    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), on_resume=slow_resume)
    colo._chan = acks = Acks()
    colo.deliver({"t": "limit", "id": 1, "bytes": 50, "immediate": False})  # below one sample: pause
    job = threading.Thread(target=lambda: colo.micro_batch(most=4))
    job.start()
    time.sleep(0.1)
    assert colo._paused and acks.sent == [1]
    colo.deliver({"t": "limit", "id": 2, "bytes": 10_000, "immediate": False})
    assert started.wait(5.0)
    # fits one sample: answered now (in a thread, so that a delivery blocked by the resume fails, not hangs)
    d = threading.Thread(target=colo.deliver, args=({"t": "limit", "id": 3, "bytes": 130, "immediate": False},))
    d.start()
    d.join(2.0)
    assert not d.is_alive() and acks.sent == [1, 2, 3]
    finish.set()
    job.join(5.0)
    assert not job.is_alive() and not colo._paused


def test_an_order_that_leaves_no_room_stops_the_resume_and_the_job_pauses_again():
    stops = []

    def resume():
        if not stops:  # the first resume: an order comes in the middle of it
            colo.deliver({"t": "limit", "id": 3, "bytes": 50, "immediate": False})
        stops.append(colo.resume_stopped())
        return not stops[-1]

    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), on_resume=resume)
    colo._chan = acks = Acks()
    colo.deliver({"t": "limit", "id": 1, "bytes": 50, "immediate": False})
    threading.Timer(0.1, colo.deliver, args=({"t": "limit", "id": 2, "bytes": 10_000, "immediate": False},)).start()
    threading.Timer(0.8, colo.deliver, args=({"t": "limit", "id": 4, "bytes": 10_000, "immediate": False},)).start()
    assert colo.micro_batch(most=4) == 4
    assert stops == [True, False]  # stopped once, then resumed after the next raise
    assert acks.sent == [1, 2, 3, 4] and colo.paused_s >= 0.5


def test_the_first_micro_batch_after_a_resume_does_not_teach_the_memory_model():
    """It rebuilds state, so its peak is higher than its size's: recorded, it made the model predict
    that nothing fits a limit the job had run in, and under a limit that never changes (static mode)
    the job stayed paused for good."""
    peaks = iter([1_000, 2_000, 1_000])  # steady, then the micro-batch right after the resume, then steady
    colo = Colocation(memory=MemoryModel(100, 10, rel_margin=0.0), measure=(lambda: None, lambda: next(peaks)))
    colo._chan = Acks()
    colo.deliver({"t": "limit", "id": 1, "bytes": 10_000, "immediate": False})
    for i in range(3):
        if i == 1:  # paused by a limit under one sample, then resumed by one that fits
            colo.deliver({"t": "limit", "id": 2, "bytes": 50, "immediate": False})
            threading.Timer(0.1, colo.deliver, args=({"t": "limit", "id": 3, "bytes": 10_000, "immediate": False},)).start()
        m = colo.micro_batch(most=4)
        with colo.step(m):
            pass
    assert colo.memory.points == {4: 1_000}
    assert colo.memory.largest(1_050, 4) == 4  # the size it ran in still fits
