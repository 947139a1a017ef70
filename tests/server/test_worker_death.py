"""A worker process that dies under the HTTP server: the requests that needed it get HTTP 503 with the
reason (the official client, streamed and not), and the server keeps serving the model afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from computron.config import EngineConfig
from computron.engine import Engine
from computron.server.cli import DEFAULT_BUDGET, DEFAULT_WORKSPACE

from .conftest import running


@pytest.fixture(scope="module")
def workers():
    engine = Engine(EngineConfig(device="cpu", executor="workers", gpu_memory_budget=DEFAULT_BUDGET,
                                 workspace_bytes=DEFAULT_WORKSPACE))
    try:
        with running(models=("tiny-opt",), engine=engine) as live:
            yield live
    finally:
        engine.executor.shutdown()


def _kill_while_decoding(live, n: int, timeout: float = 30.0) -> int:
    """SIGKILL the worker between two engine steps once ``n`` requests are decoding; its pid."""
    def kill_if_decoding():
        if sum(bool(r.output_ids) and not r.done for r in live.engine.requests.values()) < n:
            return None
        pid = live.engine.executor.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        return pid

    deadline = time.monotonic() + timeout
    while (pid := live.call(kill_if_decoding)) is None:
        assert time.monotonic() < deadline, "the requests never decoded together"
        time.sleep(0.005)
    return pid


def test_killed_worker_answers_503_with_the_reason_and_the_model_serves_again(workers, reference, alive):
    client = openai.OpenAI(base_url=workers.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    long = dict(model="tiny-opt", max_tokens=480, temperature=0.0, extra_body={"ignore_eos": True})
    errors: dict[str, BaseException] = {}

    def plain():
        try:
            client.completions.create(prompt="the first", **long)
        except BaseException as e:  # noqa: BLE001 - the test looks at it below
            errors["plain"] = e

    thread = threading.Thread(target=plain)
    thread.start()
    stream = client.completions.create(prompt="the second", stream=True, **long)
    first = next(iter(stream))  # the stream is decoding
    assert first.choices[0].text is not None
    pid = _kill_while_decoding(workers, 2)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as streamed:
        for _ in stream:
            pass
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 5.0
    assert "worker for device 0 died (exit code -9)" in str(streamed.value)
    err = errors["plain"]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503, err
    assert "worker for device 0 died (exit code -9)" in str(err)
    assert not alive(pid)

    got = client.completions.create(model="tiny-opt", prompt="after the crash", max_tokens=12, temperature=0.0)
    assert got.choices[0].text == reference("tiny-opt", "after the crash", 12).text
    assert workers.engine.executor.status().stats["restarts"] == 1
