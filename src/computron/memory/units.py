"""Byte sizes shared by the scheduler (which accounts memory) and the executors (which allocate it).

Pure Python: the scheduler sizes regions with these functions, and the arena
hands out exactly these sizes, so the two never disagree about a byte.
"""

from __future__ import annotations

ALIGN = 512  # every region and every parameter inside a weight image starts at a multiple of this


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
