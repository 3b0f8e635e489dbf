"""Thinking: whether a model's template can think, the switches a request sets, and splitting the reasoning a
model writes (`<think>...</think>`) from its answer as the output streams.

(The template's switches are set from `think` by `ChatTemplate.render`.) A template can think when it has a thinking switch or marker: a Go template naming `.Think` (as Ollama checks),
a Jinja one naming `enable_thinking`, `reasoning_content`, `<think>` or harmony's analysis channel. It takes an
effort level ("low", "medium", "high") when it names `reasoning_effort` (Jinja) or `.ThinkLevel` (Go).
"""

from __future__ import annotations

from typing import Any

from corral.errors import CorralError
from corral.template import is_go_template
from corral.toolcalls import Parsed

LEVELS = ("low", "medium", "high")
OPEN, CLOSE = "<think>", "</think>"
_JINJA_MARKERS = ("enable_thinking", "reasoning_content", OPEN, "<|channel|>analysis")


class ThinkError(CorralError):
    """A request's think / reasoning_effort value is unusable."""


def can_think(source: str) -> bool:
    """Whether the template `source` has a thinking switch or markers."""
    if is_go_template(source):
        from corral.template import _go_vars

        return "think" in _go_vars(source)
    return any(marker in source for marker in _JINJA_MARKERS)


def takes_effort(source: str) -> bool:
    """Whether the template sets an effort level (gpt-oss's reasoning_effort, Ollama's .ThinkLevel)."""
    if is_go_template(source):
        from corral.template import _go_vars

        return "thinklevel" in _go_vars(source)
    return "reasoning_effort" in source


def parse_think(value: Any) -> bool | str | None:
    """Ollama's `think`: None (the model's default), true/false, or an effort level."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in LEVELS:
        return value
    raise ThinkError(f'think must be true, false, "low", "medium" or "high", got {value!r}')


class ThinkingParser:
    """Splits `<think>...</think>` from the answer; `thinking_first` when the prompt already opened the block."""

    def __init__(self, thinking_first: bool = False):
        self._buffer = ""
        self._state = "thinking" if thinking_first else "start"  # start -> thinking -> answer
        self._lead = True  # newlines right after <think> or </think> are layout, not text

    def _piece(self, text: str) -> str:
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        return text

    def feed(self, text: str) -> Parsed:
        """The thinking and content decided once `text` is appended."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        """What is left at the end of the output."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(OPEN):
                    self._buffer, self._state = stripped[len(OPEN) :], "thinking"
                    continue
                if not final and OPEN.startswith(stripped):
                    return out  # may still open a block
                self._state = "answer"
            if self._state == "answer":
                piece, self._buffer = self._buffer, ""
                return out + Parsed(self._piece(piece))
            at = self._buffer.find(CLOSE)
            if at >= 0:
                out += Parsed(thinking=self._piece(self._buffer[:at]))
                self._buffer, self._state, self._lead = self._buffer[at + len(CLOSE) :], "answer", True
                continue
            keep = 0 if final else next((n for n in range(min(len(CLOSE) - 1, len(self._buffer)), 0, -1)
                                         if self._buffer.endswith(CLOSE[:n])), 0)
            piece, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
            return out + Parsed(thinking=self._piece(piece))
