"""What a hostile or careless client can do: oversized bodies, huge stop lists, slow prompts that
must not stall other users, admin routes without their key, registrations past the host-memory
budget, pinning what cannot load, offloading what is pinned, and error messages that name the
field at fault."""

from __future__ import annotations

import threading
import time

import httpx

from .conftest import running
from .test_errors import assert_error

ADMIN = {"Authorization": "Bearer root"}


def post(live, path: str, **kw) -> httpx.Response:
    return httpx.post(live.url + path, timeout=60, **kw)


def test_body_limit_stop_list_and_params(live):
    big = b'{"model": "tiny-opt", "prompt": "' + b"x" * (9 << 20) + b'"}'  # the default limit is 8 MiB
    assert_error(post(live, "/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                 413, "limit of 8388608")

    def chunks():  # no Content-Length: the limit holds on the bytes actually read
        for _ in range(10):
            yield b" " * (1 << 20)

    assert_error(post(live, "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                 413, "limit")
    err = assert_error(post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "hi", "stop": ["x"] * 65}),
                       400, "at most 64 stop strings")
    assert err["param"] == "stop"
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                        ({"top_p": 0}, "top_p"), ({"prompt": "x" * 600}, "prompt")):
        err = assert_error(post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "hi", **body}), 400)
        assert err["param"] == param, err
    raw = b'{"model": "tiny-opt", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    err = assert_error(post(live, "/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400,
                       "could not be parsed", "4300 digits")
    assert "Content-Type" not in err["message"]


def test_body_limit_is_configurable():
    with running(models=("tiny-opt",), max_body_bytes="1KiB") as live:
        assert_error(post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "y" * 2000}), 413, "1024")
        assert post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "y" * 100,
                                                   "max_tokens": 2}).status_code == 200


def test_tokenising_does_not_stall_other_users():
    with running(models=("tiny-opt",)) as live:
        tok = live.engine.models["tiny-opt"].tokenizer
        encode, threads = tok.encode, set()

        def slow_encode(text):
            threads.add(threading.current_thread().name)
            if text.startswith("slow"):
                time.sleep(1.5)
            return encode(text)

        tok.encode = slow_encode
        slow = threading.Thread(target=post, args=(live, "/v1/completions"),
                                kwargs={"json": {"model": "tiny-opt", "prompt": "slow", "max_tokens": 2}})
        slow.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "quick", "max_tokens": 2})
        took = time.perf_counter() - t0
        slow.join()
        assert r.status_code == 200 and took < 1.0, took
        assert "computron-engine" not in threads and threads


def test_admin_off_by_default_and_its_own_key():
    with running(models=("tiny-opt",)) as live:
        assert_error(post(live, "/admin/models", json={"source": "tiny-gpt2"}), 403, "admin routes are off")
        assert_error(post(live, "/admin/models/tiny-opt/offload"), 403, "--admin-key")
    with running(models=("tiny-opt",), api_key="user", admin_key="root") as live:
        user = {"Authorization": "Bearer user"}
        assert_error(post(live, "/admin/models/tiny-opt/offload", headers=user), 401, "wrong admin key")
        assert post(live, "/admin/models/tiny-opt/offload", headers=ADMIN).status_code == 200
        assert_error(httpx.get(live.url + "/v1/models", headers=ADMIN), 401, "wrong API key")


def test_registrations_bounded_by_the_host_memory_budget():
    # tiny presets are ~0.65 MB each: the budget holds tiny-opt and one more.
    with running(models=("tiny-opt",), admin_key="root", host_memory_budget=1_500_000) as live:
        assert post(live, "/admin/models", json={"source": "tiny-gpt2", "alias": "a"}, headers=ADMIN).status_code == 201
        err = assert_error(post(live, "/admin/models", json={"source": "tiny-gpt2", "alias": "b"}, headers=ADMIN),
                           409, "not enough host memory", "'b'", "1.43 MiB")
        assert err["code"] == "host_memory"
        names = {m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]}
        assert names == {"tiny-opt", "a"}
        assert httpx.delete(live.url + "/admin/models/a", headers=ADMIN).status_code == 200
        assert post(live, "/admin/models", json={"source": "tiny-gpt2", "alias": "b"}, headers=ADMIN).status_code == 201


def test_pin_loads_or_refuses_and_a_pinned_model_stays():
    with running(models=("tiny-opt", "tiny-gpt2"), admin_key="root") as live:
        def model(name):
            return httpx.get(f"{live.url}/v1/models/{name}").json()

        r = post(live, "/admin/models/tiny-opt/pin", headers=ADMIN)
        assert r.status_code == 200 and r.json()["pinned"] and r.json()["state"] in ("resident", "loading")
        # the budget holds one tiny model: tiny-gpt2 cannot be loaded, so it cannot be pinned
        assert_error(post(live, "/admin/models/tiny-gpt2/pin", headers=ADMIN), 409, "does not fit", "pinned")
        assert model("tiny-gpt2")["pinned"] is False and model("tiny-gpt2")["state"] == "offloaded"
        assert_error(post(live, "/admin/models/tiny-opt/offload", headers=ADMIN), 409, "pinned", "unpin")
        assert model("tiny-opt")["state"] != "offloaded"
        assert post(live, "/admin/models/tiny-opt/unpin", headers=ADMIN).status_code == 200
        assert post(live, "/admin/models/tiny-opt/offload", headers=ADMIN).json()["state"] == "offloaded"
        r = post(live, "/admin/models/tiny-gpt2/pin", headers=ADMIN)
        assert r.status_code == 200 and r.json()["pinned"] and r.json()["state"] != "offloaded"
