"""Helpers shared by test directories."""

import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (from each test's source), so a suite that
# passes here passes in CI; HYPOTHESIS_PROFILE=explore draws fresh ones to look for new failures.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def save_hf_checkpoints(tmp_path_factory, configs: dict) -> dict:
    """{name: (directory, model)}: a randomly initialised `transformers` model per config, its
    weights moved off their init (so a wrong mapping shows), saved as safetensors (float32)."""
    import torch
    import transformers

    torch.manual_seed(0)
    out = {}
    for name, cfg in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, model)
    return out


@pytest.fixture(scope="session")
def hf_saver():
    """``save_hf_checkpoints`` as a fixture (conftest modules are not meant to be imported)."""
    return save_hf_checkpoints


@pytest.fixture
def alive():
    """Whether a process id is still running (signal 0)."""
    return _alive
