"""A running server switches its colocation mode (``POST /admin/colocation``) and serves its records
(``GET /colocation``): in process, on the CPU, with a bare socket as the training job."""

import time

import httpx
import pytest

from computron.colocate.arbiter import ArbiterConfig
from computron.colocate.protocol import Channel, connect
from computron.colocate.serving import Colocated
from computron.config import ComputronConfig, EngineConfig, ModelSpec, ServerConfig
from computron.engine import AsyncEngine, Engine
from computron.server import create_app
from computron.server.background import ServerThread

ADMIN = {"Authorization": "Bearer admin"}


def join(addr: str) -> tuple[Channel, dict]:
    """A job that joins the arbiter at ``addr``: its channel and the first limit it is sent."""
    ch = Channel(connect(addr, timeout=10))
    ch.sock.settimeout(10)
    ch.send({"t": "hello", "device": 0, "min_bytes": 0})
    return ch, ch.recv()


def linked_engine(tmp_path, policy: str):
    """A CPU engine with tiny-opt under a ``colocate`` link yielding by ``policy``, and a job joined to
    it whose thread acknowledges every limit; returns (engine, link, job, the yields it was sent)."""
    import threading

    from computron.colocate.serving import EngineLink

    engine = Engine(EngineConfig(device="cpu", gpu_memory_budget=6_000_000, workspace_bytes=100_000))
    engine.register_model(ModelSpec("tiny-opt"))
    cap = min(engine.core.scheduler.config.budgets)
    link = EngineLink(engine.core, str(tmp_path / "arb.sock"),
                      ArbiterConfig(mode="colocate", capacity=cap, yield_compute=policy))
    job, _ = join(link.server.address)
    got: list[bool] = []

    def receive():
        while (msg := job.recv()) is not None:
            if msg["t"] == "yield":
                got.append(msg["on"])
            else:
                job.send({"t": "ack", "id": msg["id"], "bytes": msg["bytes"], "received": time.monotonic(),
                          "released": time.monotonic()})

    threading.Thread(target=receive, daemon=True).start()
    return engine, link, job, got


def test_switching_modes_at_run_time(tmp_path):
    addr = str(tmp_path / "arb.sock")
    cfg = ComputronConfig(engine=EngineConfig(device="cpu", gpu_memory_budget=3_000_000, workspace_bytes=100_000),
                          server=ServerConfig(admin_key="admin"), models=[ModelSpec("tiny-opt")])
    engine = Engine(cfg.engine)
    ae = AsyncEngine(engine)
    cap = min(engine.core.scheduler.config.budgets)
    colocated = Colocated(ae, addr, ArbiterConfig(mode="normal", capacity=cap))
    try:
        with ServerThread(create_app(ae, cfg, colocated)) as server:
            http = httpx.Client(base_url=server.url, timeout=30)
            deadline = time.monotonic() + 60
            while http.get("/health").status_code != 200:  # /admin answers 503 until the models are in
                assert time.monotonic() < deadline
                time.sleep(0.02)
            rep = http.get("/colocation").json()
            assert rep["mode"] == "normal" and rep["capacity"] == cap and rep["trainers"] == []
            job, limit = join(addr)
            assert limit["t"] == "limit" and limit["bytes"] == cap  # normal: each side owns the device

            assert http.post("/admin/colocation", json={"mode": "static"}).status_code == 401  # the admin key's
            bad = http.post("/admin/colocation", json={"mode": "sometimes"}, headers=ADMIN)
            assert bad.status_code == 400 and "sometimes" in bad.json()["error"]["message"]
            assert http.post("/admin/colocation", json={"moed": "static"}, headers=ADMIN).status_code == 400
            bad = http.post("/admin/colocation", json={"mode": "colocate", "at_boundary": "false"}, headers=ADMIN)
            assert bad.status_code == 400 and "at_boundary must be true or false" in bad.json()["error"]["message"]
            bad = http.post("/admin/colocation", json={"yield_compute": True}, headers=ADMIN)
            assert bad.status_code == 400 and "unknown yield_compute True; known: none, cold, first-token, work" in \
                bad.json()["error"]["message"]
            bad = http.post("/admin/colocation", json={"idle_s": -1}, headers=ADMIN)
            assert bad.status_code == 400 and "idle_s" in bad.json()["error"]["message"]
            assert http.get("/colocation").json()["mode"] == "normal"  # a refused switch keeps the link

            r = http.post("/admin/colocation", json={"mode": "static", "static_train": 1_000_000}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["mode"] == "static"
            assert job.recv() is None  # the old arbiter dropped the job, which finds the new one
            job, limit = join(addr)
            assert limit["bytes"] == 1_000_000
            rep = http.get("/colocation", params={"since": rep["now"]}).json()
            assert rep["shares"] == [[cap - 1_000_000, 1_000_000]] and rep["trainers"] == [0]
            assert [lim[2] for lim in rep["limits"]] == [1_000_000]
            assert ae.call(lambda: engine.core.scheduler.shares[0]).result(10) == cap - 1_000_000

            r = http.post("/admin/colocation", json={"mode": "colocate", "idle_s": 0.5}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["idle_s"] == 0.5
            job.close()
            job, limit = join(addr)
            assert limit["bytes"] == cap  # inference starts with nothing in colocate mode
            assert ae.call(lambda: engine.core.scheduler.shares[0]).result(10) == 0
            r = http.post("/admin/colocation", json={"mode": "normal"}, headers=ADMIN)
            assert ae.call(lambda: engine.core.scheduler.shares[0]).result(10) == cap  # its whole budget again
            job.close()
    finally:
        colocated.close()
        ae.shutdown()
        engine.executor.shutdown()


def test_a_handover_is_timed_from_the_request_that_asked_for_the_memory(tmp_path):
    # The engine's clock is a fake one. A request waiting behind another of its model (batches of one)
    # asks for no more memory; a later request for a second model does: its handover counts from the
    # later request's arrival, not from the arrival of the request that waited longest.
    import threading

    from computron.colocate.serving import EngineLink
    from computron.messages import SamplingParams

    now = [0.0]
    cfg = EngineConfig(device="cpu", gpu_memory_budget=6_000_000, workspace_bytes=100_000, max_batch_size=1)
    engine = Engine(cfg, clock=lambda: now[0])
    for name in ("tiny-opt", "tiny-gpt2"):
        engine.register_model(ModelSpec(name))
    cap = min(engine.core.scheduler.config.budgets)
    link = EngineLink(engine.core, str(tmp_path / "arb.sock"), ArbiterConfig(mode="colocate", capacity=cap))
    job, limit = join(link.server.address)

    def acks():  # the job gives back whatever it is asked for at once
        while (msg := job.recv()) is not None:
            job.send({"t": "ack", "id": msg["id"], "bytes": msg["bytes"], "received": time.monotonic(),
                      "released": time.monotonic()})

    threading.Thread(target=acks, daemon=True).start()
    try:
        long = SamplingParams(max_tokens=40, temperature=0.0)
        engine.submit("tiny-opt", [1, 2, 3], long)
        now[0] = 1.0
        engine.step()  # the first handover, asked for at 0.0
        now[0] = 1.5
        waiting = engine.submit("tiny-opt", [4, 5, 6], long)  # waits for the batch of one, asking for its cache
        now[0] = 2.0
        engine.step()
        now[0] = 2.5
        engine.step()  # the needs fit: nothing asked
        now[0] = 3.0
        engine.submit("tiny-gpt2", [7, 8, 9], long)
        now[0] = 3.5
        engine.step()  # the request of 1.5 still waits, but only the one of 3.0 asked for more
        moved = [h for h in link.report()["handovers"] if h["signal_s"] is not None]
        assert [round(h["free_s"], 6) for h in moved] == [1.0, 0.5, 0.5], moved
        # the swap-ins of a handover's step are its own: the two models' loads, none for the cache's top-up
        assert [h["swap_s"] is not None and h["swap_s"] >= 0 for h in moved] == [True, False, True], moved
        assert waiting.first_token_at is None  # it waited through the last handover, which did not count it
    finally:
        job.close()
        link.close()
        engine.executor.shutdown()


@pytest.mark.parametrize("policy", ["work", "first-token"])
def test_the_engine_has_training_yield_the_compute_while_it_has_work(tmp_path, policy):
    # the job is told to yield at the first step with a request and to go on after the step that finished
    # the last one (work) or that gave it its first token (first-token); a second request does the same again
    from computron.messages import SamplingParams

    engine, link, job, got = linked_engine(tmp_path, policy)

    def seen(n):
        deadline = time.monotonic() + 5
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    try:
        for i in range(2):
            req = engine.submit("tiny-opt", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
            engine.step()  # the swap-in and the prefill: the first token
            assert req.first_token_at is not None and not req.done
            if policy == "first-token":  # the yield ended with the first token, while the request decodes
                assert seen(2 * i + 2) == [True, False] * (i + 1)
            else:
                assert seen(2 * i + 1) == [True, False] * i + [True]
            while not req.done:
                engine.step()
            # the step that ended the last request sent the end of the yield itself (not the arbiter's
            # timer for a yield nobody renews, YIELD_STALE_S later)
            assert [on for _, _, on in link.report()["yields"]][-1] is False
            assert seen(2 * i + 2) == [True, False] * (i + 1)
        assert [on for _, _, on in link.report()["yields"]] == got
    finally:
        job.close()
        link.close()
        engine.executor.shutdown()



def test_cold_yields_only_while_a_request_waits_for_its_models_swap_in_and_first_token(tmp_path):
    """``cold``: a request for a model off the device has training yield from its first step until its
    first token; a later request for the same model, resident now, is served beside training."""
    from computron.messages import SamplingParams

    engine, link, job, got = linked_engine(tmp_path, "cold")
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        cold = engine.submit("tiny-opt", [1, 2, 3], params)
        engine.step()  # the swap-in and the prefill: the first token
        assert cold.first_token_at is not None and engine.core.stats["swap_ins"] == 1
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [True, False]  # yielded for the swap-in and the prefill, not for the decode steps
        while not cold.done:
            engine.step()
        warm = engine.submit("tiny-opt", [4, 5, 6], params)
        while not warm.done:
            engine.step()
        assert engine.core.stats["swap_ins"] == 1  # it stayed resident: the second request was warm
        time.sleep(0.1)
        assert got == [True, False] and [on for _, _, on in link.report()["yields"]] == got
    finally:
        job.close()
        link.close()
        engine.executor.shutdown()

def test_a_cold_request_keeps_its_yield_after_its_model_is_loaded_until_its_first_token(tmp_path):
    """The swap-in may end a step before the prefill that gives the first token (copies in flight on a
    GPU): a request seen waiting while its model was off the device still counts once it is resident."""
    from computron.messages import SamplingParams
    from computron.scheduler import RESIDENT

    engine, link, job, _ = linked_engine(tmp_path, "cold")
    try:
        req = engine.submit("tiny-opt", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        model = engine.core.scheduler.models["tiny-opt"]
        assert model.state != RESIDENT and link._first_token(0)  # cold: it waits for the swap-in
        model.state = RESIDENT  # as when its copies have landed and its prefill has not run yet
        assert link._first_token(0)  # still the cold request's first token
        later = engine.submit("tiny-opt", [4, 5], SamplingParams(max_tokens=2, temperature=0.0))
        req.first_token_at = 1.0
        assert not link._first_token(0)  # a request that came once the model was resident is warm
        assert later.first_token_at is None
    finally:
        job.close()
        link.close()
        engine.executor.shutdown()
