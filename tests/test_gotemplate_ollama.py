"""Ollama's own template test data (template/*.gotmpl, template/testdata, template_test.go) renders byte-identical.

The fixtures under tests/data/ollama_templates are copied from ollama/ollama (see its README); the
inputs of template_test.go are translated to cases.json.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from corral.gotemplate import OllamaTemplate, TemplateError
from corral.gotemplate.ollama import collate
from corral.modelfile import ModelDefaults
from corral.gotemplate import data

DATA = pathlib.Path(__file__).parent / "data" / "ollama_templates"
CASES = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))
TEMPLATES = sorted(path.name for path in DATA.glob("*.gotmpl"))


def _read(path: pathlib.Path) -> str:
    return path.read_bytes().decode("utf-8")  # bytes as they are: no newline translation


def test_every_template_of_ollama_has_its_expected_renders():
    assert len(TEMPLATES) == 20
    for name in TEMPLATES:
        assert sorted(p.name for p in (DATA / "testdata" / name).iterdir()) == sorted(CASES["TestTemplate"]["messages"])


@pytest.mark.parametrize("case", sorted(CASES["TestTemplate"]["messages"]))
@pytest.mark.parametrize("name", TEMPLATES)
def test_ollama_template_renders_its_testdata(name, case):
    template = OllamaTemplate(_read(DATA / name).replace("\r\n", "\n"))
    rendered = template.render(CASES["TestTemplate"]["messages"][case])
    if name in CASES["TestTemplate"]["trim_trailing_space"] and rendered.endswith(" "):
        rendered = rendered[:-1]  # as template_test.go does for these five
    assert rendered == _read(DATA / "testdata" / name / case)


_WITH_MESSAGES = [(case["name"], kind) for case in CASES["TestExecuteWithMessages"] for kind in case["templates"]]


@pytest.mark.parametrize(("case_name", "kind"), _WITH_MESSAGES)
def test_execute_with_messages(case_name, kind):
    """Legacy templates (.Prompt/.Response, rendered per turn and cut after the reply) equal the .Messages one."""
    case = next(case for case in CASES["TestExecuteWithMessages"] if case["name"] == case_name)
    assert OllamaTemplate(case["templates"][kind]).render(case["messages"]) == case["expected"]


@pytest.mark.parametrize("case", CASES["TestExecuteWithSuffix"]["cases"], ids=lambda case: case["name"])
def test_execute_with_suffix(case):
    template = OllamaTemplate(CASES["TestExecuteWithSuffix"]["template"])
    rendered = template.render(case.get("messages", ()), prompt=case.get("prompt", ""), suffix=case.get("suffix", ""))
    assert rendered == case["expected"]


@pytest.mark.parametrize("case", CASES["TestParse"], ids=lambda case: case["name"])
def test_parse_finds_the_variables_ollama_finds(case):
    assert sorted(OllamaTemplate(case["template"]).vars) == case["vars"]


@pytest.mark.parametrize("case", CASES["TestParseError"], ids=lambda case: case["name"])
def test_parse_errors(case):
    with pytest.raises(TemplateError, match=case["error"]):
        OllamaTemplate(case["template"])


@pytest.mark.parametrize("case", CASES["TestCollate"], ids=lambda case: case["name"])
def test_collate(case):
    system, collated = collate([data.message(m) for m in case["messages"]])
    assert system == case["system"]
    expected = [data.message(m) for m in case["expected"]]
    assert [(m.Role, m.Content, m.ToolName) for m in collated] == [(m.Role, m.Content, m.ToolName) for m in expected]


@pytest.mark.parametrize("case", CASES["TestTemplateArguments"], ids=lambda case: case["name"])
def test_tool_arguments_and_properties(case):
    rendered = OllamaTemplate(case["template"]).render(case["messages"], tools=case.get("tools"))
    if "json" in case:
        assert json.loads(rendered) == case["json"]
    else:
        assert rendered == case["expected"]


@pytest.mark.parametrize("case", CASES["TestGenerateChat"]["cases"], ids=lambda case: case["name"])
def test_chat_prompts_with_the_models_system(case):
    """The model's SYSTEM goes first unless the chat starts with a system message of its own, as in Ollama."""
    messages = ModelDefaults(system=case["system"]).chat_messages(case["messages"])
    assert OllamaTemplate(CASES["TestGenerateChat"]["template"]).render(messages) == case["expected"]
