"""Token data for training: a text file tokenized with the model's tokenizer, or synthetic tokens.

Samples are non-overlapping windows of ``seq_len + 1`` tokens (inputs and their next-token
targets). The order is a fixed function of the seed and the position in the stream: step ``s``
of a global batch ``G`` takes stream positions ``s*G .. s*G+G-1``, each epoch a fresh seeded
permutation. So the data a step sees does not depend on how it is split into micro-batches,
on abandoned micro-batches, or on a restart from a checkpoint. Host memory (CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch


class TokenData:
    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0):
        self.tokens, self.seq_len, self.seed = tokens.long(), seq_len, seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{len(tokens)} tokens are fewer than one sample of {seq_len + 1}")
        self._perms: dict[int, torch.Tensor] = {}

    @classmethod
    def synthetic(cls, vocab_size: int, num_tokens: int, seq_len: int, seed: int = 0) -> "TokenData":
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randint(0, vocab_size, (num_tokens,), generator=gen), seq_len, seed)

    @classmethod
    def from_text(cls, path: str | Path, tokenizer, seq_len: int, seed: int = 0) -> "TokenData":
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        return cls(torch.tensor(tokenizer.encode(text), dtype=torch.long), seq_len, seed)

    def step_samples(self, step: int, global_batch: int) -> list[int]:
        """The sample ids of step ``step`` (0-based), in order."""
        out = []
        for pos in range(step * global_batch, (step + 1) * global_batch):
            epoch, i = divmod(pos, self.num_samples)
            if epoch not in self._perms:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(self.num_samples, generator=gen)}
            out.append(int(self._perms[epoch][i]))
        return out

    def batch(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each ``[len(ids), seq_len]``."""
        t = self.seq_len
        rows = torch.stack([self.tokens[i * t: i * t + t + 1] for i in ids])
        return rows[:, :-1], rows[:, 1:]
