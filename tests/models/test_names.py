"""One naming of models: serve/generate and plan accept the same names, old spellings as aliases."""

import json

import pytest

from computron.models import ALIASES, PRESETS, resolve_model
from computron.models.checkpoint import hf_config
from computron.planner.model import PRESETS as PLAN_PRESETS
from computron.planner.model import preset as plan_preset
from computron.server.admin import checked_source


@pytest.mark.parametrize("alias,name", sorted(ALIASES.items()))
def test_every_alias_names_a_preset_in_every_command(alias, name):
    assert resolve_model(alias) == (PRESETS[name], None)
    assert resolve_model(alias.upper())[0] is PRESETS[name]
    assert checked_source(alias, []) == name  # run-time registration through /admin
    assert plan_preset(alias).name == name


def test_models_the_planner_knows_are_served_under_the_same_name():
    shared = set(PLAN_PRESETS) & set(PRESETS)
    assert {"gpt2-medium", "gpt2-xl", "llama-2-7b", "llama-3-70b"} <= shared
    assert set(PLAN_PRESETS) - shared == {n for n in PLAN_PRESETS if n.startswith("gpt3-")}  # training-only shapes
    for name in shared:
        m, e = PLAN_PRESETS[name], PRESETS[name]
        assert (m.layers, m.hidden, m.heads, m.kv, m.ffn, m.vocab) == (
            e.num_layers, e.hidden_size, e.num_heads, e.kv_heads, e.ffn_size, e.vocab_size)


def test_a_checkpoint_directory_named_like_an_alias_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2-1.5b").mkdir()
    assert resolve_model("gpt2-1.5b") == (PRESETS["gpt2-xl"], None)  # no config.json: not a checkpoint
    (tmp_path / "gpt2-1.5b" / "config.json").write_text(json.dumps(hf_config(PRESETS["tiny-gpt2"])))
    cfg, path = resolve_model("gpt2-1.5b")
    assert (cfg.num_layers, path) == (2, "gpt2-1.5b")
