"""A step's time from a ``Calibration`` (``sim/costs.py``, which gives these to every caller): pure
functions the simulated executor calls at every step and every run's bound, so they are compiled with it
(``computron._fast``). Numbers are declared ``float``: a compiled build takes an int there too, and the
sums are the same doubles Python makes of mixed ints and floats."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .costs import Calibration


def batch_time(cal: Calibration, nbytes: float, prefill_tokens: float, decode_seqs: float,
               prefill_seqs: float | None = None) -> float:
    """Seconds of one batch of a model of ``nbytes`` weight bytes: ``prefill_tokens`` prompt tokens
    (of ``prefill_seqs`` prompts; one when not given and there are any) and ``decode_seqs`` sequences
    decoding one token each (the weights warm on the device). The server's per-stream work
    (``server_seq_s`` for every sequence that makes a token) comes on top of the weight-read floor:
    it is host work on the engine's process, not hidden behind the device's."""
    if prefill_tokens:
        t = cal.prefill_fixed_s + cal.prefill_fixed_s_per_byte * nbytes + \
            prefill_tokens * (cal.prefill_token_s + cal.prefill_token_s_per_byte * nbytes)
    else:
        t = cal.decode_fixed_s + cal.decode_fixed_s_per_byte * nbytes
    if decode_seqs:
        t += decode_seqs * (cal.decode_seq_s + cal.decode_seq_s_per_byte * nbytes)
    floor = nbytes / cal.hbm_bandwidth
    if t < floor:
        t = floor
    if cal.server_seq_s:
        if prefill_seqs is None:
            prefill_seqs = 1 if prefill_tokens else 0
        t += (prefill_seqs + decode_seqs) * cal.server_seq_s
    return t


def pipelined_finish(start: float, compute_s: float, group_bytes: Sequence[float],
                     group_ready: Sequence[float]) -> float:
    """When a batch that starts at ``start`` ends if layer group *i* computes only once its copy has
    landed (``group_ready[i]``): each group's compute is ``compute_s`` split by its share of the bytes."""
    total = sum(group_bytes) or 1
    t = start
    for nbytes, ready in zip(group_bytes, group_ready):
        if ready > t:
            t = ready
        t += compute_s * nbytes / total
    return t
