"""Measured per-layer profiles (written by ``plan profile``), read without torch.

What flows through: a JSON or YAML profile file becomes a :class:`ProfileTable`; the cost model
asks it ``lookup(gpu, tp, mbs)`` and gets (forward s, backward s, activation bytes) of one layer
on one TP rank, communication excluded, or None when that GPU/tp was not measured (the roofline
is used then); ``lookup_part`` the same for other parts the profile measured (entries with
``"part": "head"``: the last stage's norm, logits and loss; ``"recompute"``: a layer whose
activations are recomputed in the backward); ``lookup_step`` a layer's (or part's) forward plus
backward timed back to back as a step issues them (an entry's ``step_s``, which profiles made
before it was measured lack: None then), or with ``graphed`` the two replayed as one CUDA graph (an
entry's ``graph_s``: CUDA profiles made since it was measured). Between measured micro-batch sizes
times are interpolated linearly; outside them they are scaled in proportion to the micro-batch size
from the nearest measurement (the cost model scales a layer instead as the roofline does,
``CostModel.layer``).
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left
from dataclasses import dataclass, field

from .errors import PlannerError
from .model import TransformerShape

FORMAT = "computron-plan-profile/1"
SHAPE_KEYS = ("family", "hidden", "heads", "kv_heads", "ffn", "seq_len", "flash_attention", "activation", "pre_norm")


def model_shape(m: TransformerShape) -> dict:
    """The fields of a model a layer profile depends on. A stored profile lacks the ones added
    since (``activation``, ``pre_norm``), and is not checked on them: it was measured with the
    family's default layer (gelu_new or silu, pre-norm) and is used as it is."""
    return {"family": m.family, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv, "ffn": m.ffn,
            "seq_len": m.seq_len, "flash_attention": bool(m.flash_attention), "activation": m.activation,
            "pre_norm": m.pre_norm}


def _interpolate(rows: list[tuple], mbs: int) -> tuple:
    """The measurement at ``mbs`` from rows sorted by micro-batch size ``(mbs, x, y, ...)``: exact,
    linear between two sizes, or in proportion to the size from the nearest one (None stays None)."""
    sizes = [r[0] for r in rows]
    i = bisect_left(sizes, mbs)
    if i < len(rows) and sizes[i] == mbs:
        return rows[i][1:]
    if 0 < i < len(rows):
        (b0, *v0), (b1, *v1) = rows[i - 1], rows[i]
        w = (mbs - b0) / (b1 - b0)
        return tuple(None if a is None or b is None else a + w * (b - a) for a, b in zip(v0, v1))
    b0, *v0 = rows[0] if i == 0 else rows[-1]
    return tuple(None if a is None else a * mbs / b0 for a in v0)


@dataclass
class ProfileTable:
    """Measured costs for one GPU type: ``entries[tp]`` = sorted [(mbs, fwd_s, bwd_s, act_bytes)] of one
    layer; ``parts[part][tp]`` = sorted [(mbs, fwd_s, bwd_s)] of another measured part: ``head`` (the
    last stage's norm, logits and loss), ``recompute`` (one layer with full activation recomputation,
    as the training runtime checkpoints it); ``steps[part][tp]`` = sorted [(mbs, step_s or None)] of
    the layer (part ``layer``) and the other parts, where the entries carry ``step_s``; ``graphs`` the
    same of ``graph_s``."""

    gpu: str
    shape: dict
    entries: dict[int, list[tuple[int, float, float, float | None]]] = field(default_factory=dict)
    source: str = ""
    parts: dict[str, dict[int, list[tuple[int, float, float]]]] = field(default_factory=dict)
    steps: dict[str, dict[int, list[tuple[int, float | None]]]] = field(default_factory=dict)
    graphs: dict[str, dict[int, list[tuple[int, float | None]]]] = field(default_factory=dict)

    def check_model(self, m: TransformerShape) -> None:
        """Raise when the profile was measured for another layer shape."""
        want = model_shape(m)
        diff = [f"{k}={self.shape.get(k)!r} (model has {want[k]!r})" for k in SHAPE_KEYS if k in self.shape and self.shape[k] != want[k]]
        if diff:
            raise PlannerError(f"profile {self.source or ''} was measured for another layer shape: {', '.join(diff)}")

    def nearest_size(self, tp: int, mbs: int) -> int:
        """The measured micro-batch size of one layer at ``tp`` nearest ``mbs`` when ``mbs`` is outside
        the measured range; ``mbs`` itself inside it (or when tp was not measured)."""
        sizes = [r[0] for r in self.entries.get(tp, ())]
        return min(max(mbs, sizes[0]), sizes[-1]) if sizes else mbs

    def lookup(self, gpu: str, tp: int, mbs: int) -> tuple[float, float, float | None] | None:
        """(fwd_s, bwd_s, act_bytes) for one layer, or None when this GPU type / tp was not measured."""
        if gpu != self.gpu or tp not in self.entries:
            return None
        return _interpolate(self.entries[tp], mbs)

    def lookup_part(self, part: str, gpu: str, tp: int, mbs: int) -> tuple[float, float] | None:
        """(fwd_s, bwd_s) of ``part`` (``head``, ``recompute``) on one TP rank, or None when not measured."""
        rows = self.parts.get(part, {}).get(tp) if gpu == self.gpu else None
        return None if rows is None else _interpolate(rows, mbs)

    def lookup_step(self, part: str, gpu: str, tp: int, mbs: int, graphed: bool = False) -> float | None:
        """``step_s`` of ``part`` (``layer``, ``recompute``, ...) on one TP rank: its forward and backward
        timed back to back (``graphed``: ``graph_s``, the two replayed as one CUDA graph), or None where
        not measured (a profile made before it was, or another GPU)."""
        rows = (self.graphs if graphed else self.steps).get(part, {}).get(tp) if gpu == self.gpu else None
        return None if rows is None else _interpolate(rows, mbs)[0]


def table_from_dict(data: dict, source: str = "", gpu: str | None = None) -> ProfileTable:
    """Build a table from a parsed profile file; ``gpu`` overrides the file's GPU type name."""
    if not isinstance(data, dict) or "entries" not in data:
        raise PlannerError(f"profile {source}: not a planner profile (no 'entries'; expected format {FORMAT})")
    entries: dict[int, list] = {}
    parts: dict[str, dict[int, list]] = {}
    timed: dict[str, dict[str, dict[int, list]]] = {"step_s": {}, "graph_s": {}}
    for e in data["entries"]:
        try:
            for key, by_part in timed.items():
                by_part.setdefault(e.get("part", "layer"), {}).setdefault(int(e["tp"]), []).append(
                    (int(e["mbs"]), None if e.get(key) is None else float(e[key])))
            if e.get("part", "layer") != "layer":
                parts.setdefault(e["part"], {}).setdefault(int(e["tp"]), []).append(
                    (int(e["mbs"]), float(e["fwd_s"]), float(e["bwd_s"])))
                continue
            row = (int(e["mbs"]), float(e["fwd_s"]), float(e["bwd_s"]),
                   None if e.get("act_bytes") is None else float(e["act_bytes"]))
            entries.setdefault(int(e["tp"]), []).append(row)
        except (KeyError, TypeError, ValueError) as err:
            raise PlannerError(f"profile {source}: bad entry {e!r} ({err})") from None
    for rows in (*entries.values(), *(r for by_tp in parts.values() for r in by_tp.values())):
        rows.sort()
    # a part's sizes without the timing give None (never interpolated over); a part without any, no rows
    for key, by_part in timed.items():
        kept = {part: {tp: sorted(rows, key=lambda r: r[0]) for tp, rows in by_tp.items()
                       if any(v is not None for _, v in rows)} for part, by_tp in by_part.items()}
        timed[key] = {part: by_tp for part, by_tp in kept.items() if by_tp}
    name = (gpu or data.get("gpu") or "").lower()
    if not name:
        raise PlannerError(f"profile {source}: no GPU type recorded; pass the GPU type it was measured on")
    return ProfileTable(name, dict(data.get("model", {})), entries, source, parts, timed["step_s"], timed["graph_s"])


def load_profile(path: str, gpu: str | None = None) -> ProfileTable:
    """Read a JSON (or YAML) profile file written by ``computron plan profile``."""
    if not os.path.isfile(path):
        raise PlannerError(f"profile file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        data = yaml.safe_load(text)
    return table_from_dict(data, path, gpu)
