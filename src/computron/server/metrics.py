"""Prometheus metrics of one app, in a registry of its own (no process-global state).

Two sources feed it. Per-request figures (status, tokens, time to first token, latency) are
recorded by the request handlers as requests end. Engine figures (queues, memory, totals of
swaps) are read in one snapshot taken on the engine thread at scrape time, and per-model swap
events arrive through ``Engine.listeners`` (called on the engine thread; prometheus-client is
thread-safe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATES = ("resident", "loading", "offloaded")


def engine_snapshot(engine) -> dict:
    """What a scrape needs from the engine; call on the engine thread."""
    models = {}
    for name in engine.models:
        st = engine.model_stats(name)
        models[name] = {k: st[k] for k in ("waiting", "running", "state", "pinned", "slo_met", "slo_requests")
                        if k in st}
    ahead = engine.executor.status().stats  # the executor's own counters (run-ahead)
    stats = dict(engine.stats)
    stats.update({k: ahead[k] for k in ("run_ahead_used", "run_ahead_dropped", "graph_captures", "graph_capture_s")
                  if k in ahead})
    return {"models": models, "memory": engine.memory(), "stats": stats}


class _EngineTotals:
    """Counters the engine keeps itself (``Engine.stats``), exposed from the last snapshot."""

    def __init__(self):
        self.stats: dict = {}
        self.slo: dict[str, tuple[int, int]] = {}  # slo policy: model -> (requests within their SLO, requests)

    def collect(self):
        if self.slo:
            met = CounterMetricFamily("computron_slo_met", "Requests that ended within their model's SLO "
                                      "(time to first token and per output token; slo policy)", labels=["model"])
            total = CounterMetricFamily("computron_slo_requests", "Requests that ended, refused ones included "
                                        "(slo policy)", labels=["model"])
            share = GaugeMetricFamily("computron_slo_attainment", "Share of a model's ended requests within its "
                                      "SLO (slo policy)", labels=["model"])
            for model, (m, n) in sorted(self.slo.items()):
                met.add_metric([model], m)
                total.add_metric([model], n)
                if n:
                    share.add_metric([model], m / n)
            yield from (met, total, share)
        s = self.stats
        for name, key, doc in (
                ("computron_swap_ins", "swap_ins", "Models swapped into device memory"),
                ("computron_evictions", "evictions", "Models evicted from device memory"),
                ("computron_swap_in_bytes", "swap_in_bytes", "Bytes of weights swapped in"),
                ("computron_swap_in_seconds", "swap_in_seconds", "Seconds spent copying weights in"),
                ("computron_engine_steps", "steps", "Engine steps run"),
                ("computron_engine_step_seconds", "step_seconds", "Wall seconds the engine thread spent in steps "
                 "that ran a batch: its host work and the waits for the device (over computron_engine_steps: "
                 "a step's mean, to set against a calibration's)"),
                ("computron_shared_steps", "shared_steps", "Steps that ran the batches of several models on one "
                 "device (--models-per-step)"),
                ("computron_preemptions", "preemptions", "Running requests stopped to recompute their caches later "
                 "(preempt policy, memory for a growing request, a restarted worker)"),
                ("computron_pauses", "pauses", "Running requests stopped with their caches kept on the device "
                 "(preempt policy with --preempt-keep-kv)"),
                ("computron_kv_offloaded", "kv_offloaded", "Stopped requests whose caches were moved to host "
                 "memory (--kv-host)"),
                ("computron_kv_moved_bytes", "kv_moved_bytes", "Bytes of stopped requests' caches moved between "
                 "device and host memory, both ways"),
                ("computron_prefill_tokens", "prefill_tokens", "Prompt tokens computed by prefills (recomputes "
                 "after preemption included; the choices of one prompt share its prefill)"),
                ("computron_run_ahead_used", "run_ahead_used", "Decode steps started before the engine asked for "
                 "them that were its next step (run-ahead)"),
                ("computron_run_ahead_dropped", "run_ahead_dropped", "Decode steps started ahead and then dropped: "
                 "the engine's next step was another (device time spent for nothing)"),
                ("computron_graph_captures", "graph_captures", "CUDA graphs of decode steps captured (again after "
                 "a model's weights moved: a reload elsewhere, the arena compacted)"),
                ("computron_graph_capture_seconds", "graph_capture_s", "Seconds spent capturing decode graphs, "
                 "their warm-up runs included")):
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("computron_requests", "Generation requests by model, endpoint and HTTP status "
                                "(499: the client went away)", ["model", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("computron_prompt_tokens", "Prompt tokens of answered requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("computron_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("computron_time_to_first_token_seconds", "Arrival to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("computron_request_latency_seconds", "Arrival to last token", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("computron_queue_depth", "Requests waiting for their model", ["model"], registry=r)
        self.running = Gauge("computron_running_requests", "Requests in the running batch", ["model"], registry=r)
        self.state = Gauge("computron_model_state", "1 for the state a model is in", ["model", "state"], registry=r)
        self.pinned = Gauge("computron_model_pinned", "1 while a model is pinned on the device", ["model"],
                            registry=r)
        self.memory = Gauge("computron_gpu_memory_used_bytes", "Device memory in use, by tag (weights, kv)",
                            ["tag"], registry=r)
        self.capacity = Gauge("computron_gpu_memory_capacity_bytes", "Device memory sizes: the whole budget, "
                              "and the arena (the budget less the workspace) that weights and KV cache share",
                              ["kind"], registry=r)
        self.swaps = Counter("computron_model_swaps", "Swaps by model and kind (load, evict)", ["model", "kind"],
                             registry=r)
        self.swap_bytes = Counter("computron_model_swap_bytes", "Bytes moved by swaps, by model and kind",
                                  ["model", "kind"], registry=r)
        self.swap_seconds = Histogram("computron_swap_seconds", "Seconds a swap took, by kind", ["kind"],
                                      buckets=SWAP_BUCKETS, registry=r)
        self.ready = Gauge("computron_ready", "1 once start-up registration is done", registry=r)
        self._totals = _EngineTotals()
        r.register(self._totals)

    # ---- feeds -------------------------------------------------------------------------------
    def on_swap(self, kind: str, model: str, seconds: float, nbytes: int) -> None:
        """An ``Engine.listeners`` entry."""
        self.swaps.labels(model, kind).inc()
        self.swap_bytes.labels(model, kind).inc(nbytes)
        self.swap_seconds.labels(kind).observe(seconds)

    def request_done(self, model: str, endpoint: str, status: int, req=None) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()
        if req is None:
            return
        self.prompt_tokens.labels(model).inc(len(req.prompt_ids))
        self.generation_tokens.labels(model).inc(len(req.output_ids))
        if status == 200 and req.finished_at is not None:
            if req.first_token_at is not None:
                self.ttft.labels(model).observe(req.first_token_at - req.arrival)
            self.latency.labels(model).observe(req.finished_at - req.arrival)

    def update(self, snap: dict) -> None:
        for g in (self.queue, self.running, self.state, self.pinned):
            g.clear()
        for name, m in snap["models"].items():
            self.queue.labels(name).set(m["waiting"])
            self.running.labels(name).set(m["running"])
            self.pinned.labels(name).set(int(m["pinned"]))
            for s in STATES:
                self.state.labels(name, s).set(int(m["state"] == s))
        mem = snap["memory"]
        for tag in ("weights", "kv"):
            self.memory.labels(tag).set(mem.get(tag, 0))
        self.capacity.labels("budget").set(mem.get("budget", 0))
        self.capacity.labels("arena").set(mem.get("total", 0))
        self._totals.stats = snap["stats"]
        self._totals.slo = {name: (m["slo_met"], m["slo_requests"]) for name, m in snap["models"].items()
                            if "slo_requests" in m}

    def render(self) -> bytes:
        return generate_latest(self.registry)
