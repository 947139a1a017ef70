"""ParallelDims: the validated parallel layout of one model (data, tensor, pipeline degrees).

A plain value object shared by the planner (which emits it) and the engine (which consumes it).
No torch import: it lives wherever a layout is described, CPU-only code included.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), tensor (tp), pipeline (pp) and context (cp: the sequence split over
    ranks for attention) parallelism; world size = dp*tp*pp*cp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def validate_for(self, *, num_layers: int, num_heads: int, num_kv_heads: int | None = None) -> None:
        """Raise ValueError when this layout cannot shard a model of that shape."""
        kv = num_kv_heads or num_heads
        if num_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {num_heads} attention heads")
        if kv % self.tp and self.tp % kv:
            raise ValueError(f"tp={self.tp} and the {kv} key/value heads do not divide one another")
        if self.pp > num_layers:
            raise ValueError(f"pp={self.pp} exceeds the {num_layers} layers")

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" cp={self.cp}" if self.cp > 1 else "")
