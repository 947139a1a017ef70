"""The planner's one exception type: bad input or an impossible request, with a readable message."""

from __future__ import annotations


class PlannerError(ValueError):
    """Raised for bad planner input (unknown names, malformed specs, impossible layouts).

    The CLI prints the message and exits with status 2; library callers can catch ValueError.
    """
