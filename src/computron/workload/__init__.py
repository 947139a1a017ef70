"""Synthetic and imported request workloads (pure Python + numpy; no torch).

What flows through: arrival processes (`arrivals`) give sorted arrival times per model; length
distributions (`lengths`) give prompt/output token counts; `make_workload` (`make`) composes
them into a `Trace` of `Request(time, model, prompt_tokens, output_tokens)` sorted by time
(`trace`), which reads and writes JSONL. `importers` turn the Azure LLM-inference CSV into a
Trace and ShareGPT JSON into (prompt, output) pairs for `Pairs`.

    from computron.workload import make_workload
    trace = make_workload(["a", "b", "c"], rate=10.0, duration=60, cv=4, skew=1.0,
                          prompt=(64, 512), output=128, seed=1)
    trace.write_jsonl("w.jsonl")
"""

from .arrivals import Bursts, Gamma, Poisson, as_rng, model_rates, power_law_weights
from .importers import parse_timestamp_ns, read_azure_csv, read_sharegpt, sharegpt_pairs
from .lengths import Fixed, Lengths, Pairs, Uniform, as_length
from .make import make_workload
from .trace import Request, Trace, TraceFormatError, parse_jsonl

__all__ = [
    "Bursts", "Fixed", "Gamma", "Lengths", "Pairs", "Poisson", "Request", "Trace",
    "TraceFormatError", "Uniform", "as_length", "as_rng", "make_workload", "model_rates",
    "parse_jsonl", "parse_timestamp_ns", "power_law_weights", "read_azure_csv",
    "read_sharegpt", "sharegpt_pairs",
]
