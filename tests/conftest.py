"""Helpers shared by test directories."""

import os

import pytest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def alive():
    """Whether a process id is still running (signal 0)."""
    return _alive
