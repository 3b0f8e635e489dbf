"""Templates' thinking switches set from `think`, on real templates (llama.cpp's models/templates)."""

from __future__ import annotations

import pytest

from corral.template import ChatTemplate
from corral.thinking import can_think, takes_effort

HI = [{"role": "user", "content": "hi"}]


def template(llama_cpp_dir, name: str) -> ChatTemplate:
    return ChatTemplate((llama_cpp_dir / "models" / "templates" / f"{name}.jinja").read_text())


@pytest.mark.peers
@pytest.mark.parametrize("name, thinks, effort", [
    ("Qwen-Qwen3-0.6B", True, False),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, False),
    ("openai-gpt-oss-120b", True, True),
    ("meta-llama-Llama-3.1-8B-Instruct", False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", False, False),
])
def test_which_templates_think_and_take_an_effort(llama_cpp_dir, name, thinks, effort):
    source = template(llama_cpp_dir, name).source
    assert (can_think(source), takes_effort(source)) == (thinks, effort)


@pytest.mark.peers
def test_think_sets_qwen3s_enable_thinking(llama_cpp_dir):
    qwen3 = template(llama_cpp_dir, "Qwen-Qwen3-0.6B")
    assert qwen3.render(HI, think=False).endswith("<think>\n\n</think>\n\n")
    assert qwen3.render(HI, think=True).endswith("<|im_start|>assistant\n")


@pytest.mark.peers
def test_an_effort_level_sets_gpt_oss_reasoning(llama_cpp_dir):
    gpt_oss = template(llama_cpp_dir, "openai-gpt-oss-120b")
    assert "Reasoning: high" in gpt_oss.render(HI, think="high")
    assert "Reasoning: low" in gpt_oss.render(HI, think="low")


def test_think_sets_a_go_templates_think_and_level():
    go = ChatTemplate("{{ if .Think }}think {{ .ThinkLevel }}{{ else }}plain{{ end }}{{ range .Messages }}{{ .Content }}{{ end }}")
    assert go.render(HI, think="medium") == "think mediumhi"
    assert go.render(HI, think=False) == "plainhi"
