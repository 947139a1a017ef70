"""Sampling parameters (validated on the host) and the sampler (runs on the device, per row).

Each request with a seed owns a generator, so its tokens do not depend on what else shares
its batch. Temperature 0 (or below ``GREEDY_BELOW``) is greedy: dividing logits by a vanishing
temperature would overflow them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            errors.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            errors.append(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            errors.append(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            errors.append(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            errors.append("stop must be a list of non-empty strings")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]; returns int64 [B] on the logits' device."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for i, (p, gen) in enumerate(zip(params, generators)):
        row = logits[i].float()
        if p.greedy:
            out[i] = row.argmax()
            continue
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the smallest prefix reaching top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out[i] = torch.multinomial(row.softmax(-1), 1, generator=gen)[0]
    return out
