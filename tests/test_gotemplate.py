"""The Go text/template engine's semantics, construct by construct (Go's documented behaviour)."""

from __future__ import annotations

import datetime
import re

import pytest

from corral.gotemplate import OllamaTemplate, TemplateError
from corral.gotemplate.execute import execute
from corral.gotemplate.funcs import BUILTINS
from corral.gotemplate.ollama import FUNCTIONS
from corral.gotemplate.parser import parse
from corral.gotemplate.values import format_float
from corral.template import is_go_template

DATA = {
    "S": "str", "Empty": "", "L": [1, 2, 3, 4, 5], "M": {"b": 1, "a": 2}, "F": 1000000.0, "G": 3.0, "H": 0.5,
    "V": {"b": "<x>&", "a": 1.5, "c": [True, None]}, "Msgs": [{"Content": "first"}], "E": [],
}  # fmt: skip


def render(source: str, data=DATA) -> str:
    return execute(parse(source, FUNCTIONS), data, FUNCTIONS)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("a  {{- 1 -}}  b", "a1b"),
        ("{{-3}}", "-3"),
        ("x {{ 3 -}}\n\t y", "x 3y"),
        ("a{{/* a comment */}}b", "ab"),
        ("a \n{{- /* trimmed */ -}}\n b", "ab"),
        ('{{ $x := "a" }}{{ $x = "b" }}{{ $x }}', "b"),
        ("{{ $n := 0 }}{{ range .L }}{{ $n = . }}{{ end }}{{ $n }}", "5"),
        ("{{ range $k, $v := .M }}{{ $k }}={{ $v }},{{ end }}", "a=2,b=1,"),
        ("{{ range $i, $v := .L }}{{ $i }}{{ $v }}{{ end }}", "0112233445"),
        ("{{ range $v := .L }}{{ $v }}{{ end }}", "12345"),
        ("{{ range .E }}x{{ else }}empty{{ end }}", "empty"),
        ("{{ range .Nope }}x{{ else }}none{{ end }}", "none"),
        ("{{ range 3 }}{{ . }}{{ end }}", "012"),
        ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}", "13"),
        ("{{ with .Nope }}x{{ else with .S }}{{ . }}{{ end }}", "str"),
        ("{{ with .S }}{{ . }}{{ else }}no{{ end }}", "str"),
        ("{{ range .E }}x{{ else if .S }}y{{ end }}{{ end }}", "y"),
        ("{{ if .Empty }}x{{ else with .S }}{{ . }}{{ end }}{{ end }}", "str"),
        ('{{ if eq .Empty "x" }}a{{ else if eq .S "y" "str" }}b{{ else }}c{{ end }}', "b"),
        ('{{ eq .S "a" "b" "str" }} {{ ne 1 2 }} {{ eq .Nope "x" }}', "true true false"),
        ('{{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1.5 2.5 }}', "true true true false"),
        ('{{ or .Empty "default" }} {{ and 1 0 }} {{ and 1 "x" }} {{ or 0 "" }}', "default 0 x "),
        ("{{ and false (index .L 10) }}", "false"),
        ("{{ not .Empty }} {{ not .L }} {{ not .E }}", "true false true"),
        ('{{ len "héllo" }} {{ len .L }} {{ len .M }}', "6 5 2"),
        ('{{ index .L 1 }} {{ index .M "a" }} {{ slice "hello" 1 3 }} {{ slice .L 3 }}', "2 2 el [4 5]"),
        ('{{ print 1 2 "a" 3 }}|{{ println "a" 1 }}|', "1 2a3|a 1\n|"),
        ('{{ printf "%d-%s-%v-%q-%5s|%-3d|" 3 "x" true "y" "ab" 7 }}', '3-x-true-"y"-   ab|7  |'),
        ('{{ printf "%s %s" "one" }}', "one %!s(MISSING)"),
        ('{{ printf "%s|%d|%v|%s" 3 "x" nil nil }}', "%!s(int=3)|%!d(string=x)|<nil>|%!s(<nil>)"),
        ("{{ .Nope }}", "<no value>"),
        ("{{ print nil }} {{ .V.c }}", "<nil> [true <nil>]"),
        ("{{ .F }} {{ .G }} {{ .H }} {{ .M }} {{ .L }}", "1e+06 3 0.5 map[a:2 b:1] [1 2 3 4 5]"),
        ("{{ json .V }}", '{"a":1.5,"b":"\\u003cx\\u003e\\u0026","c":[true,null]}'),
        ('{{ json .F }} {{ json 1e-7 }} {{ json "é\\n" }}', '1000000 1e-7 "é\\n"'),
        ('{{ define "T" }}[{{ . }}]{{ end }}{{ template "T" "x" }}{{ template "T" .S }}', "[x][str]"),
        ('{{ block "B" .S }}<{{ . }}>{{ end }}', "<str>"),
        ("{{ (index .Msgs 0).Content }}", "first"),
        ('{{ "x" | printf "%s-%s" "a" }}', "a-x"),
        ("{{ \"a\\tb\\u00e9\\x41\" }}|{{ `a\\n` }}|{{ 'a' }}", "a\tbéA|a\\n|97"),
        ("{{ $.S }}{{ with .Msgs }}{{ $.S }}{{ end }}", "strstr"),
        ("{{ html \"<a href='x'>&</a>\" }}", "&lt;a href=&#39;x&#39;&gt;&amp;&lt;/a&gt;"),
        ("{{ 0x1F }} {{ 1_000 }} {{ 2.50 }} {{ true }}", "31 1000 2.5 true"),
    ],
)
def test_go_semantics(source, expected):
    assert render(source) == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ foo .S }}", 'function "foo" not defined'),
        ("{{ call .S }}", 'function "call" not defined'),
        ("{{ end }}", "unexpected {{end}}"),
        ("{{ .S ", "unclosed action"),
        ("{{ if .S }}x", "unexpected EOF"),
        ("{{ break }}", "{{break}} outside {{range}}"),
        ("{{ if true }}{{ $y := 1 }}{{ end }}{{ $y }}", 'undefined variable "$y"'),
        ("{{ $x = 1 }}", 'undefined variable "$x"'),
        ("{{/* unterminated }}", "unclosed comment"),
        ("{{ /* not at the delimiter */ }}", "unrecognized character in action: U+002F '/'"),
        ('{{ "bad \\q" }}', "bad quoted string"),
        ("{{ .S | }}", "missing command"),
        ("{{ nil }}", "nil is not a command"),
        ('{{ if .S }}{{ define "x" }}{{ end }}{{ end }}', "unexpected <define> in command"),
    ],
)
def test_parse_errors_are_go_errors(source, message):
    with pytest.raises(TemplateError, match=re.escape(message)):
        parse(source, FUNCTIONS)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('{{ eq 1 "1" }}', "incompatible types for comparison"),
        ("{{ index .L 10 }}", "index out of range: 10"),
        ("{{ .S.Field }}", "can't evaluate field Field in type string"),
        ("{{ .Nope.Field }}", "nil pointer evaluating interface {}.Field"),
        ("{{ len 3 }}", "len of type int"),
        ("{{ range .S }}{{ end }}", "range can't iterate over str"),
        ('{{ lt 1 "a" }}', "incompatible types for comparison"),
        ('{{ template "missing" . }}', 'no template "missing"'),
    ],
)
def test_execution_errors_are_template_errors(source, message):
    with pytest.raises(TemplateError, match=message):
        render(source)


def test_builtins_alone_lack_ollamas_helpers():
    with pytest.raises(TemplateError, match='function "json" not defined'):
        parse("{{ json . }}", BUILTINS)


def test_legacy_templates_render_each_turn_and_stop_after_the_last_response():
    template = OllamaTemplate("{{ .System }}|{{ .Prompt }}|{{ .Response }}|END\n")
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert template.render(messages) == "S|u1|a1|END\n|u2|"


def test_a_template_without_response_or_messages_gets_response_appended():
    template = OllamaTemplate("<{{ .Prompt }}>")
    assert (
        template.render([{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}])
        == "<u1>a1<u2>"
    )


def test_ollama_helpers():
    template = OllamaTemplate(
        "{{ range .Messages }}{{ end }}{{ currentDate }} {{ yesterdayDate }}"
        "{{ range .Tools }}{{ range $k, $v := .Function.Parameters.Properties }} {{ $k }}: {{ toTypeScriptType $v }};{{ end }}{{ end }}"
        " {{ toTypeScriptType .System }}"
    )
    properties = {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "array"}, "d": {"type": ["string", "null"]}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}]
    today = datetime.date.today()
    expected = (
        f"{today.isoformat()} {(today - datetime.timedelta(days=1)).isoformat()} a: string; b: number; c: any[]; d: string | null; any"
    )
    assert template.render([{"role": "user", "content": "x"}], tools=tools) == expected


def test_messages_and_tools_as_ollama_gives_them():
    template = OllamaTemplate(
        "{{ .Tools }}|{{ range .Messages }}{{ .Role }}:{{ .Content }}:{{ .ToolCalls }}:{{ .ToolName }};{{ end }}"
        "|{{ .System }}|{{ .Response }}|{{ .Think }}"
    )
    messages = [
        {"role": "SYSTEM", "content": "s1"},
        {"role": "system", "content": "s2"},
        {"role": "Tool", "content": "42", "tool_name": "f"},
    ]
    # Roles are lower-cased, consecutive system messages merged, no tools print as JSON null.
    assert template.render(messages) == "null|system:s1\n\ns2:[]:;tool:42:[]:f;|s1\n\ns2||false"


def test_tool_call_arguments_print_as_json_and_range_in_key_order():
    template = OllamaTemplate(
        "{{ range .Messages }}{{ range .ToolCalls }}{{ .Function.Arguments }} "
        "{{ range $k, $v := .Function.Arguments }}{{ $k }}={{ $v }},{{ end }}{{ end }}{{ end }}"
    )
    call = {"function": {"name": "f", "arguments": {"z": 2, "a": {"y": 1, "x": [1.5, "<"]}, "n": 1000000}}}
    rendered = template.render([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert rendered == '{"a":{"x":[1.5,"\\u003c"],"y":1},"n":1000000,"z":2} a=map[x:[1.5 <] y:1],n=1e+06,z=2,'


@pytest.mark.parametrize(
    ("value", "g", "json_text"),
    [
        (1e21, "1e+21", "1e+21"),
        (123456.0, "123456", "123456"),
        (1234567.0, "1.234567e+06", "1234567"),
        (0.0001, "0.0001", "0.0001"),
        (0.00001, "1e-05", "0.00001"),
        (1e-7, "1e-07", "1e-7"),
        (-2.5, "-2.5", "-2.5"),
        (1e20, "1e+20", "100000000000000000000"),
    ],
)
def test_floats_print_as_go_prints_them(value, g, json_text):
    assert (format_float(value, "g"), format_float(value, "json")) == (g, json_text)


@pytest.mark.parametrize(
    ("source", "go"),
    [
        ("{{ .Prompt }}", True),
        ("{{ json .Tools }}", True),
        ("{{- $x := 1 }}{{ $x }}", True),
        ("{{ if .System }}x{{ end }}", True),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
        ("{% if x %}{{ .y }}{% endif %}", False),
        ("{{ bos_token }}{{ messages[0]['content'] }}", False),
        ("{{ 1.5 }}", False),
        ("plain text", False),
    ],
)
def test_the_syntax_decides_jinja_or_go(source, go):
    assert is_go_template(source) is go


def test_the_rule_tells_every_shipped_template_apart():
    import pathlib

    import corral.plugins.architectures as architectures

    jinja = sorted((pathlib.Path(architectures.__file__).parent / "templates").glob("*.jinja"))
    go = sorted((pathlib.Path(__file__).parent / "data" / "ollama_templates").glob("*.gotmpl"))
    assert jinja and len(go) == 20
    assert not [path.name for path in jinja if is_go_template(path.read_text())]
    assert all(is_go_template(path.read_text()) for path in go)


def test_tools_encode_as_ollamas_go_types_do():
    """omitempty drops empty slices and strings, but not an empty object held by an `any` or a pointer field."""
    template = OllamaTemplate("{{ range .Messages }}{{ end }}{{ .Tools }}")
    properties = {"o": {"type": "object", "properties": {}, "items": {}, "default": 1}, "p": {"type": "string", "enum": []}}
    parameters = {"type": "object", "$defs": {}, "properties": properties, "additionalProperties": False}
    tools = [{"type": "function", "items": {}, "function": {"name": "f", "parameters": parameters}, "strict": True}]
    expected = (
        '[{"type":"function","items":{},"function":{"name":"f","description":"","parameters":{"type":"object","$defs":{},'
        '"properties":{"o":{"type":"object","items":{},"properties":{}},"p":{"type":"string"}}}}}]'
    )
    assert template.render([{"role": "user", "content": "x"}], tools=tools) == expected
