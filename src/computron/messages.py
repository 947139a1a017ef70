"""Typed messages between the engine and an executor (in process, or a worker per GPU).

Only ids, ints and small dataclasses cross this boundary: token ids in, token ids out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine.sampling import SamplingParams


@dataclass
class SeqInput:
    req_id: str
    tokens: list[int]  # the new tokens of this step (the prompt on prefill, one token on decode)
    past: int  # tokens already in the request's cache
    capacity: int  # cache capacity in tokens (prompt + max_tokens), set at prefill
    params: SamplingParams


@dataclass
class ExecuteBatch:
    model: str
    seqs: list[SeqInput]


@dataclass
class StepResult:
    tokens: dict[str, int]
    load_s: dict[str, float] = field(default_factory=dict)  # model -> seconds of its swap-in copies
    compute_s: float = 0.0
