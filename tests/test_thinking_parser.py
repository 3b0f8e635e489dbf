"""Thinking split from the answer on strings, however the output is split into stream pieces."""

from __future__ import annotations

import pytest

from corral.thinking import ThinkError, ThinkingParser, can_think, parse_think, takes_effort


def split(text: str, at: int, thinking_first: bool = False):
    parser = ThinkingParser(thinking_first)
    return parser.feed(text[:at]) + parser.feed(text[at:]) + parser.finish()


@pytest.mark.parametrize("text, first, thinking, content", [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.\n", "Paris."),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("Paris, no thinking.", False, "", "Paris, no thinking."),
    ("<thinking is a word", False, "", "<thinking is a word"),
    ("<think>never closed", False, "never closed", ""),
])
def test_thinking_is_split_from_the_answer_at_any_stream_split(text, first, thinking, content):
    for at in range(len(text) + 1):
        parsed = split(text, at, first)
        assert (parsed.thinking, parsed.content) == (thinking, content), at


def test_thinking_streams_before_the_block_closes():
    parser = ThinkingParser()
    assert parser.feed("<think>Step one, ").thinking == "Step one, "
    assert parser.feed("two</thi").thinking == "two"
    parsed = parser.feed("nk>Answer")
    assert (parsed.thinking, parsed.content) == ("", "Answer")


def test_templates_that_can_think_and_take_effort():
    assert can_think("{% if enable_thinking %}<think>{% endif %}")
    assert not can_think("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert can_think("{{ if .Think }}/think{{ end }}{{ .Prompt }}")
    assert not can_think("{{ .Prompt }}")
    assert takes_effort("Reasoning: {{ reasoning_effort }}<|channel|>analysis")
    assert not takes_effort("{% if enable_thinking %}{% endif %}")


def test_think_values():
    assert [parse_think(v) for v in (None, True, False, "high")] == [None, True, False, "high"]
    with pytest.raises(ThinkError):
        parse_think("maximum")
