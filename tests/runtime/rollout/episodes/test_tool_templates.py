"""rollout.tools need a chat template that renders `tools`: checked by rendering (a conversation
with a probe tool must name it), on the families' released templates -- Qwen2-VL's (which
Qwen2.5-VL ships byte for byte) renders none and is refused before any model loads; Qwen2.5's,
Llama 3.1's and Qwen3-VL's render them."""
from __future__ import annotations

import json

import pytest

import real_model
import vlm_families
import vlm_model
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.rollout.multi_turn import check_episode_template

TOOLS = "rollout.tools=tool_helpers:echo"

#: family -> its released tokenizer as the fixtures build it (tests/fixtures/README.md)
TOKENIZERS = {
    "qwen2_vl": vlm_model.build_vlm_tokenizer,  # Qwen2-VL's and Qwen2.5-VL's released template
    "qwen3_vl": lambda: vlm_families.build_family_tokenizer("qwen3_vl"),
    "qwen2.5": lambda: real_model.build_tokenizer("qwen2.5"),
    "llama3.1": lambda: real_model.build_tokenizer("llama3.1"),
}


@pytest.mark.parametrize(("family", "renders"), [("qwen2_vl", False), ("qwen3_vl", True), ("qwen2.5", True),
                                                 ("llama3.1", True)])
def test_a_template_that_does_not_render_tools_is_refused_naming_its_file(family, renders, tmp_path) -> None:
    tok = TOKENIZERS[family]()
    tok.save_pretrained(tmp_path)  # as a release is: the template in chat_template.jinja
    cfg = load_config(None, [TOOLS])
    if renders:
        check_episode_template(cfg, tok, tmp_path)
        return
    with pytest.raises(ConfigError) as e:
        check_episode_template(cfg, tok, tmp_path)
    said = str(e.value)
    assert e.value.exit_code == 2
    assert f"the chat template of {tmp_path / 'chat_template.jinja'} does not render tools" in said
    assert "never see the schemas of echo" in said and "data.system_prompt" in said


def test_tools_described_in_the_system_prompt_are_accepted_with_any_template(tmp_path) -> None:
    tok = vlm_model.build_vlm_tokenizer()
    described = load_config(None, [TOOLS, "data.system_prompt=You may call echo(text) to repeat a text."])
    check_episode_template(described, tok, tmp_path)
    with pytest.raises(ConfigError, match="never see the schemas of echo"):  # another tool's name is not enough
        check_episode_template(load_config(None, [TOOLS, "data.system_prompt=Use the tools."]), tok, tmp_path)


def test_a_tools_run_on_qwen2_vl_is_refused_before_the_model_loads(vlm_model, tmp_path, monkeypatch) -> None:
    from rldsl.runtime.run.plan import load_spec, plan_run

    monkeypatch.setattr("rldsl.runtime.models.loading.load_policy",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(4)))
    cfg = load_config(None, [f"model.path={vlm_model}", f"out={tmp_path / 'run'}", f"data.path={data}", TOOLS])
    with pytest.raises(ConfigError, match="does not render tools") as e:
        plan_run(load_spec("grpo"), cfg)
    assert str(vlm_model) in str(e.value) and e.value.exit_code == 2
    assert not (tmp_path / "run").exists()
