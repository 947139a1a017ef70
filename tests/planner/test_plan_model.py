"""The planner names a model as the engine does, keeps its old names as aliases, and agrees on shapes."""

import pytest

from computron.models.presets import PRESETS as ENGINE_PRESETS
from computron.planner import cli
from computron.planner.errors import PlannerError
from computron.planner.model import ALIASES, PRESETS, load_model, preset

SHARED = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b"}
FAMILY = {"gpt": "gpt2", "llama": "llama"}


def test_models_both_know_go_by_the_engines_name_with_the_same_shape():
    assert set(PRESETS) & set(ENGINE_PRESETS) == SHARED
    for name in SHARED:
        m, e = PRESETS[name], ENGINE_PRESETS[name]
        assert (FAMILY[m.family], m.layers, m.hidden, m.heads, m.kv, m.ffn, m.vocab, m.seq_len) == (
            e.family, e.num_layers, e.hidden_size, e.num_heads, e.kv_heads, e.ffn_size, e.vocab_size, e.max_position)


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_old_names_resolve_to_the_canonical_preset(old, new):
    assert preset(old) is PRESETS[new]
    assert preset(old.upper()).name == new
    assert load_model(old, global_batch=8) == load_model(new, global_batch=8)


def test_unknown_model_lists_canonical_names_only():
    with pytest.raises(PlannerError) as e:
        preset("llama-9")
    msg = str(e.value)
    assert "llama-2-7b" in msg and "llama-3-70b" in msg and "llama2-7b" not in msg


def test_cli_takes_the_engines_spelling_and_the_old_one(capsys):
    outs = []
    for name in ("llama-2-7b", "llama2-7b"):
        assert cli.main(["estimate", "--model", name, "--cluster", "a100-80gb:8x1", "--tp", "8", "--pp", "1",
                         "--dp", "1", "--mbs", "1", "--global-batch", "8"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("llama-2-7b:")
