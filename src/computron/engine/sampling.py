"""The sampler: one token per row of a batch of logits, on the device (parameters: ``messages``).

Each request with a seed owns a generator, so its tokens do not depend on what else shares
its batch. Temperature 0 (or below ``messages.GREEDY_BELOW``) is greedy: dividing logits by a vanishing
temperature would overflow them.
"""

from __future__ import annotations

import torch

from ..messages import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]; returns int64 [B] on the logits' device.

    Host: one [B, 4] table of per-row knobs (temperature, top_k, top_p, greedy), sent to the
    device in one transfer, and one exponential draw per seeded, non-greedy row. Device, for
    the whole batch at once: temperature, then one sort of the batch for the masks (top-k: rank
    in the sorted order below k; top-p: the smallest prefix whose mass, after top-k, reaches
    top_p, i.e. a token is dropped once the mass before it reaches top_p; the top token always
    survives), then the draw as an exponential race, token = argmax(prob / E) with E ~ Exp(1),
    which picks each token with its probability. E is drawn in vocabulary order, so a seeded
    row's token depends only on its logits and its own generator, never on the rest of the
    batch. Greedy rows take the argmax of their logits.
    """
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    B, V = logits.shape
    dev = logits.device
    # top_k 0 is off (k = V); top_p 1 is off (2: a cumulative sum that rounds to 1 never reaches it).
    knobs = torch.tensor(
        [[1.0 if p.greedy else p.temperature, min(p.top_k or V, V), p.top_p if p.top_p < 1.0 else 2.0, p.greedy]
         for p in params], dtype=torch.float32, device=dev)
    temperature, top_k, top_p, greedy = knobs.unbind(dim=1)
    logits = logits.float()
    scaled = logits / temperature[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params if not p.greedy):
        srt, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(V, dtype=torch.float32, device=dev)
        srt = srt.masked_fill(rank >= top_k[:, None], float("-inf"))  # top-k by rank
        probs = srt.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # mass before the token
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(drop, 0.0))  # un-sort
    else:
        probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()  # unseeded rows share the default generator
    for i, (p, g) in enumerate(zip(params, generators)):
        if g is not None and not p.greedy:
            noise[i].exponential_(generator=g)  # a seeded row draws only from its own generator
    drawn = (probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)  # E = 0 would make 0/0
    return torch.where(greedy > 0, logits.argmax(dim=-1), drawn)
