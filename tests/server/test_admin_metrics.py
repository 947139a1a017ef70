"""Admin endpoints (register at run time, load, offload, pin, unpin, delete; checkpoint paths confined
to the model directories) and the Prometheus metrics moving as requests are served."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from computron.memory.host import HostImage
from computron.memory.layout import layout_for
from computron.models import get_preset, save_checkpoint
from computron.models.preset_tokenizer import write_tokenizer

from .conftest import running
from .test_errors import assert_error


TEMPLATE = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


def tiny_checkpoint(path, preset: str = "tiny-opt"):
    """The preset's random weights (seed 0, as the engine makes them) saved as an HF checkpoint."""
    cfg = get_preset(preset)
    image = HostImage(layout_for(cfg), pin=False)
    image.fill_random(cfg, 0, "cpu")
    return save_checkpoint(path, cfg, image.views)


@pytest.fixture(scope="module")
def admin(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    (root / "models").mkdir()
    tiny_checkpoint(root / "models" / "opt-ckpt")
    chat = tiny_checkpoint(root / "models" / "opt-chat")
    write_tokenizer(get_preset("tiny-opt"), chat)  # the preset's tokenizer, with a chat template added
    tok_config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))
    tiny_checkpoint(root / "outside" / "secret-ckpt")
    os.symlink(root / "outside" / "secret-ckpt", root / "models" / "link-out")
    with running(models=("tiny-opt",), model_dirs=[str(root / "models")], admin_key=ADMIN_KEY) as live:
        live.root = root
        yield live


ADMIN_KEY = "adm1n"


def api(live, method: str, path: str, key: str | None = ADMIN_KEY, **kw) -> httpx.Response:
    """A request with the admin key (which the /v1 routes ignore while no API key is set)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, live.url + path, timeout=30, headers=headers, **kw)


def state(live, name: str) -> dict:
    return api(live, "GET", f"/v1/models/{name}").json()


def complete(live, model: str, **kw) -> httpx.Response:
    return api(live, "POST", "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 6,
                                                       "temperature": 0, **kw})


def test_register_load_offload_pin_delete(admin):
    r = api(admin, "POST", "/admin/models", json={"source": "tiny-gpt2", "alias": "extra"})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "extra" and r.json()["state"] == "offloaded"
    assert "extra" in {m["id"] for m in api(admin, "GET", "/v1/models").json()["data"]}
    assert_error(api(admin, "POST", "/admin/models", json={"source": "tiny-gpt2", "alias": "extra"}), 409, "extra")

    assert complete(admin, "tiny-opt").status_code == 200  # tiny-opt resident now
    r = api(admin, "POST", "/admin/models/extra/load")
    assert r.status_code == 200 and r.json()["state"] == "resident"
    assert state(admin, "tiny-opt")["state"] == "offloaded"  # one model fits: loading evicted it

    assert api(admin, "POST", "/admin/models/extra/pin").json()["pinned"] is True
    assert api(admin, "POST", "/admin/models/extra/unpin").json()["pinned"] is False
    r = api(admin, "POST", "/admin/models/extra/offload")
    assert r.status_code == 200 and r.json()["state"] == "offloaded"
    assert complete(admin, "extra").status_code == 200

    r = api(admin, "DELETE", "/admin/models/extra")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert_error(complete(admin, "extra"), 404, "tiny-opt")
    assert_error(api(admin, "DELETE", "/admin/models/extra"), 404, "extra")
    for action in ("load", "offload", "pin", "unpin"):
        assert_error(api(admin, "POST", f"/admin/models/nope/{action}"), 404, "nope")


def test_register_with_load_and_pinned(admin):
    r = api(admin, "POST", "/admin/models", json={"source": "tiny-llama", "alias": "llama2", "load": True,
                                                  "pinned": True})
    assert r.status_code == 201 and r.json()["state"] == "resident" and r.json()["pinned"]
    api(admin, "POST", "/admin/models/llama2/unpin")
    assert api(admin, "DELETE", "/admin/models/llama2").status_code == 200


def test_checkpoint_inside_model_dirs(admin, reference):
    path = admin.root / "models" / "opt-ckpt"
    r = api(admin, "POST", "/admin/models", json={"source": str(path)})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "opt-ckpt"
    # Same weights as the tiny-opt preset: the same greedy text.
    assert complete(admin, "opt-ckpt").json()["choices"][0]["text"] == reference("tiny-opt", "hello", 6).text
    assert api(admin, "DELETE", "/admin/models/opt-ckpt").status_code == 200


def test_chat_template_from_tokenizer_config(admin, reference):
    assert api(admin, "POST", "/admin/models", json={"source": str(admin.root / "models" / "opt-chat")}).status_code == 201
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = api(admin, "POST", "/v1/chat/completions", json={"model": "opt-chat", "messages": messages, "max_tokens": 6,
                                                         "temperature": 0})
    assert r.status_code == 200, r.text
    prompt = "[system|be brief][user|hi]=>"  # the checkpoint's template, not the plain default
    ref = reference("tiny-opt", prompt, 6)
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_ids)
    assert ref.prompt_ids[0] == 256 and ref.prompt_ids.count(256) == 1  # BOS once
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    # A preset has no template: the plain default "role: content" lines, then "assistant:".
    r = api(admin, "POST", "/v1/chat/completions", json={"model": "tiny-opt", "messages": messages, "max_tokens": 6,
                                                         "temperature": 0})
    ref = reference("tiny-opt", "system: be brief\nuser: hi\nassistant:", 6)
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_ids)
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert api(admin, "DELETE", "/admin/models/opt-chat").status_code == 200


def test_checkpoint_outside_model_dirs_refused(admin):
    root = admin.root
    for source in (root / "outside" / "secret-ckpt",  # elsewhere
                   root / "models" / ".." / "outside" / "secret-ckpt",  # climbing out
                   root / "models" / "link-out",  # a symlink inside pointing outside
                   "/etc"):
        err = assert_error(api(admin, "POST", "/admin/models", json={"source": str(source)}), 403, "outside")
        assert err["param"] == "source"
    assert_error(api(admin, "POST", "/admin/models", json={"source": str(root / "models" / "missing")}), 400,
                 "config.json")
    assert_error(api(admin, "POST", "/admin/models", json={"source": "no-such-preset"}), 400, "tiny-opt")
    assert_error(api(admin, "POST", "/admin/models", json={"source": "tiny-opt", "dtype": "int3"}), 400, "dtype")
    names = {m["id"] for m in api(admin, "GET", "/v1/models").json()["data"]}
    assert not names & {"secret-ckpt", "link-out"}


def test_metrics_move(live):
    labels = dict(model="tiny-opt", endpoint="completions", status="200")
    before = {k: live.metric(k, **({"model": "tiny-opt"} if k != "computron_requests_total" else labels))
              for k in ("computron_requests_total", "computron_time_to_first_token_seconds_count",
                        "computron_request_latency_seconds_count", "computron_generation_tokens_total")}
    unknown = live.metric("computron_requests_total", model="unknown", endpoint="completions", status="404")
    for _ in range(2):
        assert complete(live, "tiny-opt").status_code == 200
    assert complete(live, "tiny-gpt2").status_code == 200
    complete(live, "no-such-model")
    after = {k: live.metric(k, **({"model": "tiny-opt"} if k != "computron_requests_total" else labels))
             for k in before}
    assert after["computron_requests_total"] == before["computron_requests_total"] + 2
    assert after["computron_time_to_first_token_seconds_count"] == before["computron_time_to_first_token_seconds_count"] + 2
    assert after["computron_request_latency_seconds_count"] == before["computron_request_latency_seconds_count"] + 2
    assert after["computron_generation_tokens_total"] == before["computron_generation_tokens_total"] + 12
    assert live.metric("computron_requests_total", model="unknown", endpoint="completions", status="404") == unknown + 1

    text = httpx.get(live.url + "/metrics").text
    assert live.metric("computron_swap_ins_total") >= 2 and live.metric("computron_evictions_total") >= 1
    assert live.metric("computron_swap_in_bytes_total") > 0
    assert live.metric("computron_model_swaps_total", kind="load", model="tiny-gpt2") >= 1
    assert 'computron_swap_seconds_count{kind="load"}' in text
    assert live.metric("computron_gpu_memory_used_bytes", tag="weights") > 0
    assert 'computron_gpu_memory_used_bytes{tag="kv"}' in text
    assert live.metric("computron_gpu_memory_capacity_bytes", kind="budget") > live.metric(
        "computron_gpu_memory_capacity_bytes", kind="arena") > 0
    assert 'computron_queue_depth{model="tiny-llama"} 0.0' in text
    assert live.metric("computron_model_state", model="tiny-gpt2", state="resident") == 1
    assert live.metric("computron_ready") == 1
    steps, busy = live.metric("computron_engine_steps_total"), live.metric("computron_engine_step_seconds_total")
    assert steps >= 12 and 0 < busy < 60  # the engine thread's time in the steps of these requests


def test_request_that_cannot_fit_beside_a_pinned_model_is_503_and_health_counts_admin_models(admin):
    assert api(admin, "GET", "/health").json()["models"] == 1
    assert api(admin, "POST", "/admin/models", json={"source": "tiny-gpt2", "alias": "blocked"}).status_code == 201
    assert api(admin, "GET", "/health").json()["models"] == 2  # counts what /admin registered
    assert api(admin, "POST", "/admin/models/tiny-opt/load").status_code == 200
    api(admin, "POST", "/admin/models/tiny-opt/pin")
    try:
        assert_error(complete(admin, "blocked"), 503, "pinned models (tiny-opt)")
        stream = api(admin, "POST", "/v1/completions", json={"model": "blocked", "prompt": "hi", "max_tokens": 4,
                                                              "stream": True})
        assert '"code":"unavailable"' in stream.text.replace(" ", "") and "pinned models (tiny-opt)" in stream.text
    finally:
        api(admin, "POST", "/admin/models/tiny-opt/unpin")
    assert complete(admin, "blocked").status_code == 200  # unpinned: it swaps in
    assert api(admin, "DELETE", "/admin/models/blocked").status_code == 200
    assert api(admin, "GET", "/health").json()["models"] == 1


def test_engine_counters_of_preemption_are_exported():
    """Preemptions (recompute) and pauses (caches kept) are read from the engine's own counters."""
    from computron.server.metrics import _EngineTotals

    totals = _EngineTotals()
    totals.stats = {"preemptions": 3, "pauses": 2, "steps": 7, "shared_steps": 5}
    got = {m.name: m.samples[0].value for m in totals.collect()}
    assert (got["computron_preemptions"], got["computron_pauses"], got["computron_engine_steps"]) == (3, 2, 7)
    assert got["computron_shared_steps"] == 5
    totals.stats["step_seconds"] = 1.5
    assert {m.name: m.samples[0].value for m in totals.collect()}["computron_engine_step_seconds"] == 1.5
