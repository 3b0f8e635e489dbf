"""Which tool-call family a real template writes, read from the template itself (llama.cpp's
models/templates), as Ollama reads it: a sample call rendered through the template."""

from __future__ import annotations

import pytest

from corral.registry import Plugins
from corral.template import ChatTemplate
from corral.toolcalls import parser_class_for

FAMILIES = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "ibm-granite-granite-4.0": "hermes",
    "Qwen3-Coder": "qwen3-coder",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command-r",
    "CohereForAI-c4ai-command-r-plus-tool_use": "command-r-plus",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek",
    "deepseek-ai-DeepSeek-V3.1": "deepseek",
    "openai-gpt-oss-120b": "harmony",
}


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    return Plugins()


@pytest.mark.peers
@pytest.mark.parametrize("name, family", sorted(FAMILIES.items()))
def test_the_family_is_read_from_the_template(llama_cpp_dir, plugins, name, family):
    source = (llama_cpp_dir / "models" / "templates" / f"{name}.jinja").read_text()
    parser = parser_class_for(ChatTemplate(source, bos_token="<s>", eos_token="</s>"), plugins)
    assert parser is not None and parser.family == family


@pytest.mark.peers
def test_a_template_with_a_json_call_no_family_names_gets_its_prefix(llama_cpp_dir, plugins):
    source = (llama_cpp_dir / "models" / "templates" / "LFM2.5-8B-A1B.jinja").read_text()
    parser = parser_class_for(ChatTemplate(source), plugins)
    assert (parser.family, parser.prefix) == ("json", "<|tool_call_start|>")


def test_a_template_without_tools_has_no_parser(plugins):
    from conftest import CHATML

    assert parser_class_for(ChatTemplate(CHATML), plugins) is None


QWEN_GO = """{{- if .Tools }}<|im_start|>system
Tools: {{ range .Tools }}{{ json . }}{{ end }}<|im_end|>
{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if .ToolCalls }}{{ range .ToolCalls }}<tool_call>
{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
</tool_call>{{ end }}{{ else }}{{ .Content }}{{ end }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
LLAMA_GO = """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ if .ToolCalls }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}
{{- else }}{{ .Content }}{{ end }}<|eot_id|>{{ end }}{{ if .Tools }}{{ end }}<|start_header_id|>assistant<|end_header_id|>

"""


@pytest.mark.parametrize("source, family", [(QWEN_GO, "hermes"), (LLAMA_GO, "llama3")])
def test_an_ollama_go_template_names_its_family_too(plugins, source, family):
    template = ChatTemplate(source)
    assert template.is_go
    assert parser_class_for(template, plugins).family == family
