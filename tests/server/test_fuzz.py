"""Property-based fuzz of the server's OpenAPI schema: no input gives a 500, and every error is in the
OpenAI shape with a 4xx status (never FastAPI's 422).

Uses schemathesis (positive and negative cases from the schema) when it is installed, and a plain
hypothesis strategy over request bodies as well, so the test runs either way. About 100 examples
in all, against a server of its own (the admin routes may be hit).
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import running

MODELS = ("tiny-opt", "tiny-gpt2")
ADMIN_KEY = "fuzz-admin"
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    with running(models=MODELS, model_dirs=[str(tmp_path_factory.mktemp("fuzz-models"))], admin_key=ADMIN_KEY) as live:
        yield live


def check(r: httpx.Response | object, what: str) -> None:
    status = r.status_code
    assert status < 500, f"{what} -> {status}: {r.text[:500]}"
    assert status != 422, f"{what} -> 422 (validation errors must be 400): {r.text[:300]}"
    if status >= 400 and status != 405:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, r.text


UNSUPPORTED = ("suffix",
               "tools", "response_format")


def short(body: dict, n: int) -> None:
    """Bound the tokens a valid request may generate (CPU time), keeping invalid values as they are.
    Without max_tokens a chat completion would run to the end of the context."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None or (isinstance(value, int) and 8 < value <= 512):
            body[key] = n


def schemathesis_available() -> bool:
    try:
        import schemathesis  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not schemathesis_available(), reason="schemathesis is not installed")
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis(fuzz_server, mode):
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    schema = schemathesis.openapi.from_dict(fuzz_server.app.openapi())
    ops = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "GET" or op.path in ("/v1/completions", "/v1/chat/completions", "/admin/models"):
            ops[op.method, op.path] = op
    assert len(ops) == 7
    strategy = st.one_of([op.as_strategy(generation_mode=GenerationMode(mode)) for op in ops.values()])
    # The spec must be true: every status and body the server sends is the one documented.
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]

    @settings(max_examples=30, **SETTINGS)
    @given(case=strategy, data=st.data())
    def run(case, data):
        body = case.body
        if isinstance(body, dict) and isinstance(body.get("model"), str) and data.draw(st.booleans()):
            body["model"] = data.draw(st.sampled_from(MODELS))  # reach the engine, not only the 404
            short(body, data.draw(st.integers(1, 8)))
            if data.draw(st.booleans()):  # and often leave out what is refused as unsupported
                for key in UNSUPPORTED:
                    body.pop(key, None)
        r = case.call(base_url=fuzz_server.url, timeout=60, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        check(r, f"{case.method} {case.formatted_path} {body!r:.300}")
        case.validate_response(r, checks=checks)

    run()


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=10)

# Valid values (token counts stay small: CPU time) ...
VALID = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.none() | st.floats(0, 2) | st.just(1e-300),
    "top_p": st.none() | st.floats(0.01, 1),
    "top_k": st.none() | st.integers(0, 1000),
    "seed": st.none() | st.integers(-(2**63), 2**64 - 1),
    "stop": st.none() | st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
}
# ... and, in half of the bodies, one field made wrong: out of range, of the wrong type, or absent.
WRONG = {
    "max_tokens": st.integers(-2, 0) | st.integers(513, 2**70) | st.floats(-10, 8),
    "temperature": st.floats(-1e6, -1e-9) | st.floats(100.01, 1e300),
    "top_p": st.floats(-1, 0) | st.floats(1.0001, 10),
    "top_k": st.integers(-(2**70), -1),
    "seed": st.integers(2**64, 2**80) | st.integers(-(2**80), -(2**63) - 1),
    "stop": st.lists(st.just(""), min_size=1, max_size=2),
    "n": st.integers(2, 5) | st.integers(-3, 0),
    "prompt": st.lists(st.integers(-3, 10**6), max_size=8) | st.lists(st.text(max_size=5), min_size=2, max_size=3)
    | st.just("") | st.just([]),
    "messages": st.just([]) | st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2),
    "model": st.text(max_size=10),
}


def bodies(kind: str):
    role = st.sampled_from(["user", "system", "assistant", "tool", "developer"])
    content = st.none() | st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                  "text": st.text(max_size=10)}),
                                                           max_size=2)
    fixed = {"model": st.sampled_from(MODELS), "max_tokens": VALID["max_tokens"]}
    if kind == "completions":
        fixed["prompt"] = st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 255), min_size=1, max_size=8)
    else:
        fixed["messages"] = st.lists(st.fixed_dictionaries({"role": role, "content": content}), min_size=1, max_size=3)
    valid = st.fixed_dictionaries(fixed, optional={k: v for k, v in VALID.items() if k != "max_tokens"})
    fields = sorted(set(fixed) | set(VALID))
    wrong = st.tuples(st.sampled_from(fields), st.booleans(), st.data())

    def spoil(body: dict, how) -> dict:
        if how is None:
            return body
        field, any_json, data = how
        if field in ("prompt", "messages", "model") and not any_json and field in body and data.draw(st.booleans()):
            body.pop(field)
        elif any_json or field not in WRONG:
            body[field] = data.draw(json_values)
        else:
            body[field] = data.draw(WRONG[field])
        return body

    return st.builds(spoil, valid, st.none() | wrong)


@settings(max_examples=40, **SETTINGS)
@given(kind=st.sampled_from(["completions", "chat/completions"]), data=st.data())
def test_hypothesis_bodies(fuzz_server, kind, data):
    body = data.draw(bodies(kind.split("/")[0]))
    r = httpx.post(f"{fuzz_server.url}/v1/{kind}", json=body, timeout=60)
    check(r, f"{kind} {body!r:.300}")
    if r.status_code == 200 and body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
