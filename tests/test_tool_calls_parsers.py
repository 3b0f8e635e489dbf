"""Tool-call parsers on strings: each family's syntax, content kept before a call, several calls in a
turn, and the same result however the output is split into stream pieces."""

from __future__ import annotations

import functools

import pytest

from corral.registry import Plugins
from corral.toolcalls import Parsed, ToolCallParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@functools.cache
def families() -> dict[str, type[ToolCallParser]]:
    return Plugins().tool_parsers()


def parse_whole(family: str, text: str) -> Parsed:
    parser = families()[family]([WEATHER])
    return parser.feed(text) + parser.finish()


def parse_split(family: str, text: str, at: int) -> Parsed:
    parser = families()[family]([WEATHER])
    return parser.feed(text[:at]) + parser.feed(text[at:]) + parser.finish()


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in parsed.calls]


CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lima"})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", {"city": "Paris"})]),
    ("phi4", 'ok <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>', "ok", [("get_weather", {"city": "Paris"})]),
    ("command-r", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>',
     "", [("get_weather", {"city": "Paris"})]),
    ("command-r-plus", 'Action:\n```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```', "", [("get_weather", {"city": "Paris"})]),
    ("qwen3-coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar is\n</parameter>\n<parameter=days>\n3\n</parameter>\n'
     '</function>\n</tool_call>', "Checking.", [("get_weather", {"city": "Par is", "days": 3})]),
    ("deepseek", "Hm.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Hm.", [("get_weather", {"city": "Paris"})]),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
     "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Rome\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("harmony", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
     '<|constrain|>json<|message|>{"city": "Paris"}<|call|>', "", [("get_weather", {"city": "Paris"})]),
    ("harmony", '<|channel|>final<|message|>It is sunny.<|return|>', "It is sunny.", []),
]


@pytest.mark.parametrize("family, text, content, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_family_parses_its_calls_and_keeps_the_content_before(family, text, content, expected):
    parsed = parse_whole(family, text)
    assert (parsed.content.strip(), calls(parsed)) == (content, expected)


@pytest.mark.parametrize("family, text, content, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_stream_split_anywhere_parses_the_same(family, text, content, expected):
    for at in range(len(text) + 1):
        parsed = parse_split(family, text, at)
        assert (parsed.content.strip(), calls(parsed)) == (content, expected), f"split at {at}: {text[:at]!r}"


def test_every_piece_streams_as_soon_as_it_cannot_start_a_call():
    parser = families()["hermes"]([WEATHER])
    assert parser.feed("Hello wor").content == "Hello wor"
    assert parser.feed("ld <tool").content == "ld "  # "<tool" may open a call: held back
    assert parser.feed("box>").content == "<toolbox>"


def test_a_call_is_emitted_as_soon_as_it_is_complete():
    parser = families()["hermes"]([WEATHER])
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {}}').calls == ()
    assert calls(parser.feed("</tool_call>")) == [("get_weather", {})]


@pytest.mark.parametrize("family, text", [
    ("hermes", "Plain text with no call."),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("llama3", "The answer is {not json"),
    ("mistral", "[TOOL_CALLS] oops"),
])
def test_text_that_is_no_call_is_content(family, text):
    parsed = parse_whole(family, text)
    assert (parsed.content, parsed.calls) == (text, ())


def test_an_unfinished_call_is_given_back_as_content():
    text = '<tool_call>{"name": "get_weather", "argu'
    assert parse_whole("hermes", text) == Parsed(text)


def test_llama3_json_after_text_is_content():
    text = 'Here is JSON: {"name": "get_weather", "parameters": {}}'
    assert parse_whole("llama3", text) == Parsed(text)


def test_harmony_analysis_is_thinking_not_content():
    text = "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    for at in range(len(text) + 1):
        parsed = parse_split("harmony", text, at)
        assert (parsed.thinking, parsed.content, parsed.calls) == ("Think first.", "Done.", ()), at


@pytest.mark.parametrize("family, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'),
    ("command-r", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]<|END_ACTION|>'),
    ("command-r-plus", 'Action:\n```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]\n```'),
    ("qwen3-coder", '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n'
     '</function>\n</tool_call>'),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
])
def test_the_call_being_written_grows_into_the_finished_call(family, text):
    """`pending` names the call once its name is written and its arguments' text only grows, ending as the call's text."""
    parser = families()[family]([WEATHER])
    seen, done = [], []
    for char in text:
        done += parser.feed(char).calls
        if not done and parser.pending() is not None:
            seen.append(parser.pending())
    done += parser.finish().calls
    (call,) = done
    assert {p.name for p in seen} == {"get_weather"}
    texts = [p.arguments for p in seen]
    assert all(call.arguments_json().startswith(t) for t in texts) and len(set(texts)) > 8
    assert call.arguments_json() == '{"city": "Paris", "days": 2}'


def test_a_qwen3_coder_string_streams_its_text_and_holds_back_what_may_close_it():
    parser = families()["qwen3-coder"]([WEATHER])
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew")
    assert parser.pending().arguments == '{"city": "New'
    parser.feed(' "York"\n</para')  # a quote escaped; the newline and the tag's start may close the value
    assert parser.pending().arguments == '{"city": "New \\"York\\"'
    parser.feed("meter>\n<parameter=days>\n1")  # a number: sent once its parameter closes
    assert parser.pending().arguments == '{"city": "New \\"York\\""'
    parser.feed("0\n</parameter>\n")
    assert parser.pending().arguments == '{"city": "New \\"York\\"", "days": 10'
    (call,) = parser.feed("</function>\n</tool_call>").calls
    assert call.arguments_json() == '{"city": "New \\"York\\"", "days": 10}'
