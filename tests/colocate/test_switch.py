"""A running server switches its colocation mode (``POST /admin/colocation``) and serves its records
(``GET /colocation``): in process, on the CPU, with a bare socket as the training job."""

import time

import httpx

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
