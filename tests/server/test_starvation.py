"""No request waits forever: a model with steady streaming traffic yields to an older request of
another model that cannot load beside it (the default server's budget holds one tiny model)."""

import threading
import time

import openai

from .conftest import running


def test_second_model_is_served_while_six_clients_stream_from_the_first():
    with running() as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stop = threading.Event()
        served = [0] * 6
        errors = []

        def stream_forever(i):
            try:
                while not stop.is_set():
                    for _ in client.completions.create(model="tiny-opt", prompt=f"client {i}", max_tokens=24 + 9 * i,
                                                       stream=True, extra_body={"ignore_eos": True}):
                        pass
                    served[i] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=stream_forever, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while sum(served) < 12 and time.monotonic() < deadline:  # lengths differ: the batch never empties
                time.sleep(0.05)
            t0 = time.monotonic()
            out = client.completions.create(model="tiny-llama", prompt="me too", max_tokens=8)
            waited = time.monotonic() - t0
            before = sum(served)
            deadline = time.monotonic() + 30
            while sum(served) < before + 6 and time.monotonic() < deadline:  # and tiny-opt resumes
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
        assert waited < 20, f"the tiny-llama request waited {waited:.1f} s"
        assert sum(served) >= before + 6, "tiny-opt did not resume after tiny-llama was served"
