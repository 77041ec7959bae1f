"""Did-you-mean: one matcher and one wording for spec names, formula defines and config keys."""
from __future__ import annotations

import pytest

import rldsl
from rldsl.errors import SpecError
from rldsl.suggest import close_matches, did_you_mean, suggestion


def test_close_matches_best_first_and_the_sentence():
    assert close_matches("grpoo", ["rloo", "gspo", "ppo", "grpo", "dapo"]) == ["grpo", "rloo", "gspo"]
    assert close_matches("grpoo", ["rloo", "gspo", "grpo"], n=1) == ["grpo"]
    assert close_matches("zzzz", ["grpo"]) == []
    assert suggestion([]) is None
    assert suggestion(["a"]) == "did you mean 'a'?"
    assert suggestion(["b", "a"]) == "did you mean one of 'b', 'a'?"
    assert did_you_mean("grpoo", ["grpo", "gspo", "dapo", "rloo"]) == "did you mean one of 'grpo', 'gspo', 'rloo'?"
    assert did_you_mean("lr", {"lr": 1}) == "did you mean 'lr'?"  # any iterable of names


def test_a_misspelt_slot_a_misspelt_define_and_a_misspelt_config_key_share_the_wording():
    from rldsl.runtime.config import load_config
    from rldsl.runtime.errors import ConfigError
    with pytest.raises(SpecError) as slot:
        rldsl.loads("algorithm a extends grpo\n  baselin    group_mean\n", "a.rl")
    assert slot.value.hint == "did you mean one of 'baseline', 'selection'?"
    with pytest.raises(SpecError) as define:
        rldsl.loads("algorithm a extends grpo\n  define length_penalty\n    r = r + 0.1\n  end\n"
                    "  shaping       length_penalti\n", "a.rl")
    assert "did you mean 'length_penalty'?" in define.value.render()
    with pytest.raises(ConfigError, match=r"did you mean 'train.lr'\?"):
        load_config(None, ["train.lrr=1"])
