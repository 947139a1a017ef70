"""The sampler: one token per row of a batch of logits, on the device (parameters: ``messages``).

Each request with a seed owns a generator, so its tokens do not depend on what else shares
its batch. Temperature 0 (or below ``messages.GREEDY_BELOW``) is greedy: dividing logits by a vanishing
temperature would overflow them.
"""

from __future__ import annotations

import torch

from ..messages import SamplingParams


class Sampler:
    """Draws one token per row of a batch's logits [B, V]; built once for a batch's parameters, so
    a run of several decode steps sends its per-row knobs to the device once and never waits on it.

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

    def __init__(self, params: list[SamplingParams], vocab: int, device):
        self.params, self.vocab = params, vocab
        self.greedy = all(p.greedy for p in params)
        if self.greedy:
            return
        # top_k 0 is off (k = V); top_p 1 is off (2: a cumulative sum that rounds to 1 never reaches it).
        knobs = torch.tensor(
            [[1.0 if p.greedy else p.temperature, min(p.top_k or vocab, vocab), p.top_p if p.top_p < 1.0 else 2.0,
              p.greedy] for p in params], dtype=torch.float32).to(device, non_blocking=True)
        self.temperature, self.top_k, self.top_p, self.rows_greedy = knobs.unbind(dim=1)
        self.masks = any(p.top_k or p.top_p < 1.0 for p in params if not p.greedy)

    def __call__(self, logits: torch.Tensor, generators: list) -> torch.Tensor:
        """int64 [B] on the logits' device."""
        if self.greedy:
            return logits.argmax(dim=-1)
        V, dev = self.vocab, logits.device
        logits = logits.float()
        scaled = logits / self.temperature[:, None]
        if self.masks:
            srt, order = scaled.sort(dim=-1, descending=True)
            rank = torch.arange(V, dtype=torch.float32, device=dev)
            srt = srt.masked_fill(rank >= self.top_k[:, None], float("-inf"))  # top-k by rank
            probs = srt.softmax(dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) >= self.top_p[:, None]  # mass before the token
            drop[:, 0] = False
            probs = torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(drop, 0.0))  # un-sort
        else:
            probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if any(g is None for g in generators):
            noise.exponential_()  # unseeded rows share the default generator
        for i, (p, g) in enumerate(zip(self.params, generators)):
            if g is not None and not p.greedy:
                noise[i].exponential_(generator=g)  # a seeded row draws only from its own generator
        drawn = (probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)  # E = 0 would make 0/0
        return torch.where(self.rows_greedy > 0, logits.argmax(dim=-1), drawn)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (see ``Sampler``); int64 [B] on the logits' device."""
    return Sampler(params, logits.shape[-1], logits.device)(logits, generators)


class History:
    """What one request's logits processors need to remember, on the device: how often each token
    was generated (frequency and presence penalties) and which tokens the prompt or the output
    hold (repetition penalty); on the host, how many tokens it generated (min_tokens).
    Kept with the request's sampling state, so a request that was preempted resumes with it."""

    def __init__(self, prompt: list[int], vocab: int, device, penalties: bool):
        self.generated = 0
        self.counts = self.seen = None
        if penalties:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt, dtype=torch.long).to(device)] = True

    @staticmethod
    def needed(p: SamplingParams) -> bool:
        return p.min_tokens > 0 or p.penalized

    def add(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True


def process(logits: torch.Tensor, params: list[SamplingParams], history: list[History | None],
            eos: int | None) -> torch.Tensor:
    """Logits [B, V] after each row's processors, for the whole batch at once on the device: the
    logit bias is added; end-of-sequence is masked until ``min_tokens``; the repetition penalty
    divides positive logits (multiplies negative ones) of tokens in the prompt or the output; the
    frequency penalty subtracts ``penalty x count`` and the presence penalty ``penalty`` for each
    token generated so far. Rows that ask for none of it are left as they are; with no row asking,
    the logits come back untouched."""
    if not any(p.logit_bias or p.min_tokens or p.penalized for p in params):
        return logits
    logits = logits.float().clone()
    B, V = logits.shape
    dev = logits.device
    rows = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < V]
    if rows:
        i, t, b = zip(*rows)
        logits.index_put_((torch.tensor(i, device=dev), torch.tensor(t, device=dev)),
                          torch.tensor(b, dtype=torch.float32, device=dev), accumulate=True)
    if eos is not None:
        hold = [i for i, (p, h) in enumerate(zip(params, history)) if p.min_tokens and h.generated < p.min_tokens]
        if hold:
            logits[torch.tensor(hold, device=dev), eos] = float("-inf")
    pen = [i for i, p in enumerate(params) if p.penalized]
    if pen:
        idx = torch.tensor(pen, device=dev)
        knobs = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                              for i in pen], dtype=torch.float32, device=dev)
        counts = torch.stack([history[i].counts for i in pen])
        seen = torch.stack([history[i].seen for i in pen])
        x = logits[idx]
        rep = torch.where(x > 0, x / knobs[:, :1], x * knobs[:, :1])
        x = torch.where(seen, rep, x)
        x = x - knobs[:, 1:2] * counts - knobs[:, 2:3] * (counts > 0)
        logits[idx] = x
    return logits


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]) -> list:
    """Per row whose ``ks`` entry is not None: (the log-probability of that row's token in ``tokens``,
    the ``k`` most likely tokens as (id, log-probability)), from the model's own distribution (the raw
    logits, before temperature, penalties or bias); None for the other rows. One log-softmax and one
    top-k for all rows on the device, one transfer back. Sampled tokens (``k`` = their params'
    ``logprobs``) and prompt tokens (the logits of the position before each) both come through here."""
    want = [i for i, k in enumerate(ks) if k is not None]
    if not want:
        return [None] * len(ks)
    idx = torch.tensor(want, device=logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[idx].view(-1, 1)).squeeze(1).tolist()
    k = max(ks[i] for i in want)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out = [None] * len(ks)
    for row, i in enumerate(want):
        n = ks[i]
        out[i] = (chosen[row], list(zip(top_i[row][:n], top_v[row][:n])))
    return out
