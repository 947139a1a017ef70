"""Byte sizes shared by the scheduler (which accounts memory) and the executors (which allocate it).

Pure Python: the scheduler sizes regions with these functions, and the arena
hands out exactly these sizes, so the two never disagree about a byte.
"""

from __future__ import annotations

ALIGN = 512  # every region and every parameter inside a weight image starts at a multiple of this
STRIPE_CHUNK = 32 * 2**20  # bytes a link moves at a time in a striped swap-in (memory/striped.py)
STRIPE_SLOTS = 2  # staging slots of a helper: one lands from the host while the other is passed on


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def kv_region_bytes(tokens: int, bytes_per_token: int) -> int:
    """Device bytes of one sequence's key/value cache holding ``tokens`` tokens."""
    return align_up(max(1, tokens * bytes_per_token))


def arena_capacity(budget: int, workspace: int | None) -> int:
    """Bytes of the arena (weights + KV cache) that a device budget leaves once the workspace for
    activations (default: a tenth of the budget, at most 2 GiB) is set aside."""
    if workspace is None:
        workspace = min(budget // 10, 2 * 2**30)
    if workspace >= budget:
        raise ValueError(f"workspace of {workspace} bytes leaves nothing of the {budget} bytes budget")
    arena = align_up(budget - workspace) - ALIGN
    if arena < ALIGN:
        raise ValueError(f"a memory budget of {budget} bytes leaves no room for weights and KV cache once "
                         f"{workspace} bytes of workspace are set aside; give at least {workspace + 2 * ALIGN} bytes")
    return arena


def staging_bytes(chunk: int, slots: int = STRIPE_SLOTS) -> int:
    """Device bytes a helper lends to a striped swap-in while it runs: its staging slots, one
    region (the scheduler books this on the helper's budget, the helper's arena hands it out)."""
    return align_up(slots * chunk)
