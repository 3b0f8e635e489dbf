"""Go text/template's lexer: template text split into text runs and the tokens of its actions.

Delimiters are `{{` and `}}`. `{{- ` trims the white space (space, tab, CR, LF) before the action and
` -}}` the white space after it; the marker needs a blank beside it, so `{{-3}}` is the number -3.
Comments are `{{/* ... */}}` (with the same trim markers) and must end where the action ends.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs

from corral.gotemplate.errors import TemplateError

LEFT, RIGHT = "{{", "}}"
_BLANKS = " \t\r\n"
KEYWORDS = frozenset({"block", "break", "continue", "define", "else", "end", "if", "range", "nil", "template", "with"})

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\n]+)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<pipe>\|)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<comma>,)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\[^\n]+?)')
  | (?P<number>[+-]?(?:
        0[xX][0-9a-fA-F_]*\.?[0-9a-fA-F_]*(?:[pP][+-]?[0-9_]+)?
      | 0[bBoO][0-9_]+
      | (?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9_]+)?
    )i?)
  | (?P<variable>\$[A-Za-z_0-9]*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z_0-9]*)+)
  | (?P<dot>\.)
  | (?P<identifier>[A-Za-z_][A-Za-z_0-9]*)
    """,
    re.VERBOSE,
)


@attrs.frozen
class Token:
    """One token: its kind (text, a _TOKEN group name, keyword, bool, left, right, eof), its text and line."""

    kind: str
    value: str
    line: int


def tokens(source: str, name: str = "") -> Iterator[Token]:
    """The tokens of `source`: text runs (already trimmed by the markers) and each action's tokens."""
    pos, line, trim_next = 0, 1, False
    while pos < len(source):
        start = source.find(LEFT, pos)
        end = len(source) if start < 0 else start
        text = source[pos:end]
        trim_before = start >= 0 and source.startswith("-", start + 2) and source[start + 3 : start + 4] in tuple(_BLANKS)
        if trim_next:
            text = text.lstrip(_BLANKS)
        if trim_before:
            text = text.rstrip(_BLANKS)
        if text:
            yield Token("text", text, line)
        line += source.count("\n", pos, end)
        if start < 0:
            break
        pos = start + 2 + (2 if trim_before else 0)
        pos, line, trim_next = yield from _action(source, pos, line, name)
    yield Token("eof", "", line)


def _action(source: str, pos: int, line: int, name: str) -> Iterator[Token]:
    """The tokens of one action starting at `pos` (after the delimiter); returns where the text resumes."""
    if source.startswith("/*", pos) and source.find("*/", pos + 2) < 0:
        raise TemplateError(f"template: {name}:{line}: unclosed comment")
    comment = re.compile(r"/\*.*?\*/", re.DOTALL).match(source, pos)
    if comment:
        after = comment.end()
        line += source.count("\n", pos, after)
        if source.startswith(RIGHT, after):
            return after + 2, line, False
        if source.startswith(" -" + RIGHT, after) or (
            source[after : after + 1] in tuple(_BLANKS) and source.startswith("-" + RIGHT, after + 1)
        ):
            return after + 4, line, True
        raise TemplateError(f"template: {name}:{line}: comment ends before closing delimiter")
    yield Token("left", LEFT, line)
    while True:
        if source.startswith(RIGHT, pos):
            yield Token("right", RIGHT, line)
            return pos + 2, line, False
        trim = re.compile(r"[ \t\r\n]+-\}\}").match(source, pos)
        if trim:
            line += source.count("\n", pos, trim.end())
            yield Token("right", RIGHT, line)
            return trim.end(), line, True
        if pos >= len(source):
            raise TemplateError(f"template: {name}:{line}: unclosed action")
        match = _TOKEN.match(source, pos)
        if match is None:
            char = source[pos]
            raise TemplateError(f"template: {name}:{line}: unrecognized character in action: U+{ord(char):04X} {char!r}")
        kind, value = match.lastgroup, match.group()
        if kind == "identifier":
            kind = "bool" if value in ("true", "false") else ("keyword" if value in KEYWORDS else kind)
            yield Token(kind, value, line)
        else:
            yield Token(kind, value, line)
        line += value.count("\n")
        pos = match.end()
