"""The grammars that hold tool calls to their schemas, checked token by token with llguidance on a tiny
model's tokenizer: a forced call admits only calls to the tools, valid for their parameters; in auto mode
the reply is free text until the family's prefix opens a call."""

from __future__ import annotations

import functools

import pytest

from corral.gguf import GGUFFile
from corral.grammar import LARK_KEY, GrammarMatcher, compile_format
from corral.registry import Plugins
from corral.tokenizer import Tokenizer
from corral.toolcalls import forced_call_grammar, lazy_call_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
    "additionalProperties": False}}}
GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tok") / "llama.gguf")
    return Tokenizer.from_gguf(GGUFFile.open(path).metadata)


@functools.cache
def family(name: str):
    return Plugins().tool_parsers()[name]


def accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    matcher = GrammarMatcher.start(tokenizer, compile_format({LARK_KEY: grammar})).matcher
    tokens = tokenizer.encode(text, add_special=False, parse_special=False)
    return matcher.try_consume_tokens(tokens) == len(tokens)


def test_a_forced_call_admits_a_valid_call_only(tokenizer):
    grammar = forced_call_grammar(family("hermes"), [WEATHER], parallel=False)
    assert accepts(tokenizer, grammar, GOOD)
    assert not accepts(tokenizer, grammar, "Sure, let me")
    assert not accepts(tokenizer, grammar, '<tool_call>{"name": "get_time"')
    assert not accepts(tokenizer, grammar, '<tool_call>{"name": "get_weather", "arguments": {"days": "two"')
    assert not accepts(tokenizer, grammar, GOOD + "\n<tool_call>")  # one call unless parallel


def test_parallel_forced_calls_may_follow_each_other(tokenizer):
    grammar = forced_call_grammar(family("hermes"), [WEATHER], parallel=True)
    assert accepts(tokenizer, grammar, GOOD + "\n" + GOOD)


def test_auto_mode_leaves_text_free_until_a_call_opens(tokenizer):
    grammar = lazy_call_grammar(family("hermes"), [WEATHER], parallel=True)
    assert accepts(tokenizer, grammar, "Any text at all, {even JSON}, and tags like <tool>.")
    assert accepts(tokenizer, grammar, "Let me check.\n" + GOOD)
    assert not accepts(tokenizer, grammar, 'Let me check.\n<tool_call>\n{"name": "rm_rf"')


@pytest.mark.parametrize("name, text", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("command-r", '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>'),
    ("command-r-plus", 'Action:\n```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```'),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ("deepseek-v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
])
def test_each_family_forces_its_own_syntax(tokenizer, name, text):
    grammar = forced_call_grammar(family(name), [WEATHER], parallel=False)
    assert accepts(tokenizer, grammar, text)
    parser = family(name)([WEATHER])
    parsed = parser.feed(text) + parser.finish()
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]


def test_auto_mode_is_unconstrained_where_the_prefix_is_a_control_token():
    assert lazy_call_grammar(family("mistral"), [WEATHER], parallel=True) is None  # [TOOL_CALLS]
    assert lazy_call_grammar(family("llama3"), [WEATHER], parallel=True) is None  # no prefix to wait for


@pytest.mark.parametrize("name, good, bad", [
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "</function>\n</tool_call>", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>"),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome", "days": 3}<｜tool▁call▁end｜>',
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"town": "Rome"'),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 3}',
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"days": "3"'),
])
def test_a_forced_call_of_the_other_families_holds_its_arguments_to_the_schema(tokenizer, name, good, bad):
    grammar = forced_call_grammar(family(name), [WEATHER], parallel=False)
    assert accepts(tokenizer, grammar, good)
    assert not accepts(tokenizer, grammar, bad)
    assert not accepts(tokenizer, grammar, "Sure, let me")


def test_qwen3_coder_parallel_calls_and_auto_mode(tokenizer):
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"
    assert accepts(tokenizer, forced_call_grammar(family("qwen3-coder"), [WEATHER], parallel=True), one + "\n" + one)
    lazy = lazy_call_grammar(family("qwen3-coder"), [WEATHER], parallel=True)
    assert accepts(tokenizer, lazy, "Let me check.\n" + one)
    assert not accepts(tokenizer, lazy, "Let me check.\n<tool_call>\n<function=rm_rf>")


def test_a_family_without_a_call_grammar_cannot_be_forced():
    from corral.toolcalls import ToolCallError, ToolCallParser

    class Plain(ToolCallParser):
        family = "plain"

    with pytest.raises(ToolCallError, match="not supported for the plain"):
        forced_call_grammar(Plain, [WEATHER], parallel=False)
