"""The slo policy behind the HTTP API: a request it refuses gets a 503 with the reason, and /metrics
counts each model's requests within their SLO."""

import httpx

from computron.config import EngineConfig
from computron.engine import Engine
from computron.server.cli import DEFAULT_BUDGET, DEFAULT_WORKSPACE

from .conftest import running
from .test_errors import assert_error


def test_refused_request_gets_503_with_its_reason_and_metrics_count_slo_attainment():
    cfg = EngineConfig(device="cpu", gpu_memory_budget=DEFAULT_BUDGET, workspace_bytes=DEFAULT_WORKSPACE,
                       policy="slo",
                       slos={"tiny-opt": {"latency_s": 1e-9},  # can never be met: refused
                             "tiny-llama": {"ttft_s": 600.0, "tpot_s": 600.0},  # always met
                             # a bound on latency is the SLO where one is given (the policy aims at it)
                             "tiny-gpt2": {"latency_s": 600.0, "ttft_s": 1e-9, "tpot_s": 1e-9}})
    with running(models=("tiny-opt", "tiny-llama", "tiny-gpt2"), engine=Engine(cfg)) as live:
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny-opt", **body}, timeout=60)
        assert_error(r, 503, "model 'tiny-opt' is overloaded", "cannot be served within its SLO", "retry later")
        for _ in range(2):
            r = httpx.post(live.url + "/v1/completions", json={"model": "tiny-llama", **body}, timeout=60)
            assert r.status_code == 200, r.text
        assert live.metric("computron_slo_requests_total", model="tiny-opt") == 1
        assert live.metric("computron_slo_met_total", model="tiny-opt") == 0
        assert live.metric("computron_slo_attainment", model="tiny-opt") == 0.0
        assert live.metric("computron_slo_requests_total", model="tiny-llama") == 2
        assert live.metric("computron_slo_met_total", model="tiny-llama") == 2
        assert live.metric("computron_slo_attainment", model="tiny-llama") == 1.0
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny-gpt2", **body}, timeout=60)
        assert r.status_code == 200, r.text
        assert live.metric("computron_slo_met_total", model="tiny-gpt2") == 1
