"""Tool calls in a model's output: which family's syntax the model writes, and parsing it as it streams.

    parser = tool_parser_for(template_source, tools, plugins)   # None: the template renders no tool calls
    for piece in stream: parsed = parser.feed(piece)              # content to show now, calls completed now
    parsed = parser.finish()                                       # at the end: what is left

Which syntax a model writes is read from its own template, as Ollama does: a sample assistant turn
holding one tool call is rendered through the template, and each installed parser family (plugins
registering through `register_tool_parsers`) is asked whether that rendering is its syntax. The first
family that recognises it wins; a template whose call is JSON after some fixed text, but that no family
names, gets the generic JSON parser with that text as its prefix.

A parser keeps content before a call, emits each call once it is complete, and handles several calls
in one turn. Text that only might start a call (a prefix split across stream pieces) is held back
until it is decided; text that looked like a call but never parsed is given back as content at the end.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any, Iterable

import attrs

from corral.errors import CorralError
from corral.grammar import JSON_OPTIONS

SAMPLE_NAME = "corral_sample_tool"
SAMPLE_ARGUMENTS = {"corral_sample_argument": "corral_sample_value"}


class ToolCallError(CorralError):
    """A request's tools or tool_choice cannot be used (bad shape, an unknown function)."""


@attrs.frozen
class ToolCall:
    """One parsed call: the function's name and its arguments (an object), with an id for the API."""

    name: str
    arguments: dict[str, Any]
    id: str = attrs.field(factory=lambda: f"call_{secrets.token_hex(12)}")
    # The arguments' JSON as the model wrote it, when it was streamed as written (OpenAI's argument fragments):
    # the whole reply then shows the same text the fragments add up to.
    arguments_text: str | None = attrs.field(default=None, eq=False)

    def ollama(self, index: int) -> dict:
        """Ollama's shape: arguments as an object."""
        return {"function": {"index": index, "name": self.name, "arguments": self.arguments}}

    def openai(self, index: int) -> dict:
        """OpenAI's shape: arguments as a JSON string."""
        return {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json()}}

    def arguments_json(self) -> str:
        """The arguments as a JSON string: as written when known, else serialised."""
        return self.arguments_text if self.arguments_text is not None else json.dumps(self.arguments, ensure_ascii=False)


@attrs.frozen
class PendingCall:
    """A call being written: its function's name, known, and its arguments' text so far (a prefix of the
    finished call's `arguments_json()`)."""

    name: str
    arguments: str


@attrs.frozen
class Parsed:
    """What one step of parsing yields: content decided to be text, and calls completed."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()
    thinking: str = ""  # reasoning the model wrote in its own channel (harmony's analysis)
    pending: PendingCall | None = None  # the call being written after this step, once its name is known

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls, self.thinking + other.thinking, other.pending)


class ToolCallParser:
    """The streaming state machine every family shares: text until `prefix`, then calls until they parse.

    A family sets `prefix` (the text that opens a call; may be empty for a bare JSON call, which must then
    start the reply) and implements `take_calls(text, final)`: the calls at the start of `text` (the
    text after the prefix) and how many characters they used, or None while they are incomplete.
    """

    family = "generic"
    prefix = ""
    # Other texts that also open a call (e.g. Llama's <|python_tag|>).
    alternative_prefixes: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._buffer = ""
        self._in_call = False
        self._opened = ""  # the prefix text that opened the current call
        self._seen_text = False  # anything but whitespace before: a bare (prefix-less) call no longer starts here

    @classmethod
    def recognises(cls, sample: str) -> bool:
        """Whether `sample` (a template's rendering of one call to SAMPLE_NAME) is this family's syntax."""
        return False

    # --- streaming ------------------------------------------------------------------------------
    def feed(self, text: str) -> Parsed:
        """The content decided and the calls completed once `text` is appended to the output."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        """Whatever is left at the end of the output: a call that never completed is content."""
        parsed = self._advance(final=True)
        rest, self._buffer = self._buffer, ""
        if self._in_call and not parsed.calls:
            rest = self._opened + rest
        return parsed + Parsed(rest)

    def _advance(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self._in_call:
                taken = self.take_calls(self._buffer, final)
                if taken is None:
                    return out
                calls, used = taken
                self._buffer = self._buffer[used:].lstrip() if calls else self._buffer
                if not calls:  # not a call after all: what opened it is content
                    out += Parsed(self._opened)
                self._in_call = False
                out += Parsed(calls=tuple(calls))
                continue
            start, opened = self._find_prefix()
            if start is None:
                keep = self._undecided_tail(final)
                content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                self._seen_text |= bool(content.strip())
                return out + Parsed(content)
            content = self._buffer[:start]
            self._seen_text |= bool(content.strip())
            self._buffer = self._buffer[start + len(opened) :]
            self._in_call, self._opened = True, opened
            out += Parsed(content.rstrip() if content.strip() else "")

    def _prefixes(self) -> tuple[str, ...]:
        return tuple(p for p in (self.prefix, *self.alternative_prefixes) if p)

    def _find_prefix(self) -> tuple[int | None, str]:
        if not self.prefix and not self._seen_text:
            stripped = self._buffer.lstrip()
            if stripped[:1] in ("{", "["):
                return len(self._buffer) - len(stripped), ""
        found = [(self._buffer.find(p), p) for p in self._prefixes() if p in self._buffer]
        return min(found) if found else (None, "")

    def _undecided_tail(self, final: bool) -> int:
        """How many characters at the end might still open a call (kept back until decided)."""
        if final:
            return 0
        if not self.prefix and not self._seen_text and not self._buffer.strip():
            return len(self._buffer)
        return opening_tail(self._buffer, tuple(prefix[:-1] for prefix in self._prefixes()))

    def take_calls(self, text: str, final: bool) -> tuple[list[ToolCall], int] | None:
        """The calls at the start of `text`, and the characters they used; ([], 0) when it is no call."""
        raise NotImplementedError

    def pending(self) -> PendingCall | None:
        """The call being written, once its name is known (None for families that only report whole calls)."""
        return None


def _json_value(text: str, final: bool) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after blanks) and where it ends; None while incomplete;
    (None, -1) when it is not JSON."""
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return None if not final and _unfinished_json(stripped) else (None, -1)
    return value, lead + end


def _unfinished_json(text: str) -> bool:
    """Whether `text`, which does not decode, may still become an object or array (a string or bracket is open)."""
    if not text or text[0] not in "{[":
        return not text
    if text[0] == "{" and text[1:].lstrip()[:1] not in ("", '"', "}"):
        return False  # an object's first key is a string
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return False  # closed, yet it did not decode: not JSON
    return True


def call_from_object(value: Any) -> ToolCall | None:
    """A call from the JSON object families write: name in name/function/tool_name, arguments in
    arguments/parameters (an object, or a JSON string of one)."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):  # OpenAI's own shape
        value = value["function"]
    name = next((value[key] for key in ("name", "function", "tool_name") if isinstance(value.get(key), str)), None)
    arguments = next((value[key] for key in ("arguments", "parameters") if key in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if name is None or not isinstance(arguments, dict):
        return None
    return ToolCall(name, arguments)


class JsonToolCallParser(ToolCallParser):
    """A call (or a list of calls) as JSON after the prefix, optionally closed by `suffix`; between
    several calls the family's `separator` (or the prefix again, handled by the state machine)."""

    suffix = ""
    separator = ";"
    name_key = "name"
    arguments_key = "arguments"
    writes_list = False  # a forced call is written as a JSON list of calls (Mistral, Granite, Command-R)
    fence = ""  # text between the prefix and the JSON (Command-R+'s ```json)
    # Whether models write the prefix as ordinary text tokens. A control token ([TOOL_CALLS], <|tool_call|>) is no
    # text to llguidance, so free text could never reach it: auto mode then leaves the reply unconstrained.
    prefix_is_text = False

    def __init__(self, tools: list[dict] | None = None, prefix: str | None = None):
        super().__init__(tools)
        if prefix is not None:
            self.prefix = prefix

    def pending(self) -> PendingCall | None:
        if not self._in_call:
            return None
        text = self._buffer.lstrip()
        if self.fence:
            if not text.startswith(self.fence):
                return None
            text = text[len(self.fence) :]
        return written_call(text)

    def take_calls(self, text: str, final: bool) -> tuple[list[ToolCall], int] | None:
        taken = self._take_calls(text, final)
        if taken and taken[0]:
            # The first call is the one `pending` reported while it was written: keep its text as written.
            written = written_call(text[: taken[1]])
            first = taken[0][0]
            if written is not None and written.name == first.name and _decodes_to(written.arguments, first.arguments):
                taken[0][0] = attrs.evolve(first, arguments_text=written.arguments)
        return taken

    def _take_calls(self, text: str, final: bool) -> tuple[list[ToolCall], int] | None:
        calls: list[ToolCall] = []
        at = 0
        while True:
            decoded = _json_value(text[at:], final)
            if decoded is None:
                return None
            value, end = decoded
            if end < 0:
                return (calls, at) if calls else ([], 0)
            found = [call_from_object(v) for v in value] if isinstance(value, list) else [call_from_object(value)]
            if not found or None in found:
                return (calls, at) if calls else ([], 0)
            calls += found
            at += end
            rest = text[at:]
            if self.suffix:
                if rest.lstrip().startswith(self.suffix):
                    at += len(rest) - len(rest.lstrip()) + len(self.suffix)
                elif not final and self.suffix.startswith(rest.lstrip()):
                    return None  # the closing text may still come
                return calls, at
            if rest.lstrip().startswith(self.separator):
                at += len(rest) - len(rest.lstrip()) + len(self.separator)
                continue
            if not final and not rest.strip():
                return None  # a separator and another call may follow
            return calls, at

    @classmethod
    def call_grammar(cls, tools: list[dict], parallel: bool, lazy: bool = False) -> str | None:
        """The Lark grammar of this family's calls to `tools` (one unless `parallel`). `lazy`: the reply may be
        text instead, and only once the prefix is written is the rest held to the calls' grammar (None when
        the family has no prefix to wait for)."""
        if lazy and not (cls.prefix and cls.prefix_is_text):
            return None
        schema = {**call_schema(tools, cls.name_key, cls.arguments_key), "x-guidance": JSON_OPTIONS}
        if cls.writes_list:
            schema = {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        # A newline may follow the prefix (and a fence) and precede the suffix, as templates write them; no other blanks.
        body = " ".join(part for part in ("NL?", f"{_lark_literal(cls.fence)} NL?" if cls.fence else "", "call",
                                          f"NL? {_lark_literal(cls.suffix)}" if cls.suffix else "") if part)
        separator = "NL?" if cls.prefix else _lark_literal(cls.separator)
        return calls_grammar(cls.prefix, body, [f"call: %json {json.dumps(schema)}"], parallel and not cls.writes_list, lazy, separator)


def calls_grammar(prefix: str, body: str, rules: list[str], parallel: bool, lazy: bool = False, separator: str = "NL?") -> str:
    """A Lark grammar (llguidance's dialect) of a reply that is calls, each `prefix` then `body` (an expression over
    `rules`; NL is a newline), one unless `parallel` (then `separator` between). `lazy`: the reply may be any text
    without the prefix instead, and only once the prefix is written is the rest held to the calls."""
    one = f"{_lark_literal(prefix)} {body}" if prefix else body
    more = f" ({separator} {one})*" if parallel else ""
    rules = [*rules, 'NL: "\\n"']
    if not lazy:
        return "\n".join([f"start: {one}{more}", *rules]) + "\n"
    # Text without the prefix, or text up to the prefix's first occurrence (one lexeme, so the lexer never has to
    # decide where text ends and a prefix starts) and then the calls.
    opens = _regex_literal(prefix)
    rules += [f"TEXT: /(?s:.+)/ & ~/(?s:.*{opens}.*)/", f"OPEN: /(?s:.*){opens}/ & ~/(?s:.*{opens}.+)/"]
    return "\n".join([f"start: TEXT | OPEN {body}{more}", *rules]) + "\n"


def _regex_literal(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


# The head of a call object as the forcing grammar writes it (and most models do): the name, then the arguments;
# other keys with a plain value may come first (Command-R's "tool_call_id").
_PLAIN_MEMBER = r'\s*"(?:[^"\\]|\\.)*"\s*:\s*(?:"(?:[^"\\]|\\.)*"|-?\d+)\s*,'
_CALL_HEAD = re.compile(
    r'\s*\[?\s*\{(?:' + _PLAIN_MEMBER + r')*?\s*"(?:name|function|tool_name)"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def written_call(text: str) -> PendingCall | None:
    """The call whose JSON object starts `text`: its name and its arguments' text so far (all of it once the
    arguments' value is complete, nothing after); None until the name and the arguments' key are written."""
    head = _CALL_HEAD.match(text)
    if head is None:
        return None
    rest = text[head.end() :]
    try:
        _, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        end = len(rest)  # still being written: all of it belongs to the arguments
    return PendingCall(json.loads(head.group(1)), rest[:end])


def settled_arguments(text: str, closers: tuple[str, ...]) -> str:
    """Of a call's arguments written so far (`text`, raw), what is sure to begin the finished arguments' stripped
    text: blanks around it and any end that may be the start of one of the `closers` (the text that ends the
    arguments) are held back until what follows decides."""
    text = text.lstrip()
    while True:
        trimmed = text.rstrip()
        trimmed = trimmed[: len(trimmed) - opening_tail(trimmed, closers)]
        if trimmed == text:
            return text
        text = trimmed


def opening_tail(text: str, openers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are the start of one of `openers` (the longest such start):
    text to hold back while what follows may complete it."""
    longest = 0
    for opener in openers:
        for size in range(min(len(opener), len(text)), longest, -1):
            if text.endswith(opener[:size]):
                longest = size
                break
    return longest


def _decodes_to(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except json.JSONDecodeError:
        return False


# --- which family a template writes ------------------------------------------------------------


def sample_call_text(render) -> str:
    """What a template writes for one assistant tool call: the rendering of a turn holding a call to
    SAMPLE_NAME, less the rendering of the same conversation up to the generation prompt."""
    # Nine alphanumerics: Mistral's templates reject any other id.
    call = {"id": "corral000", "type": "function", "function": {"name": SAMPLE_NAME, "arguments": SAMPLE_ARGUMENTS}}
    tools = [sample_tool()]
    user = {"role": "user", "content": "corral sample question"}
    before = render([user], tools, True)
    after = render([user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools, False)
    # The generation prompt may differ from the header of a finished turn (thinking markers): keep what they share.
    shared = os.path.commonprefix([before, after])
    # Cut after the last whole piece they share: `<|im_start|>assistant\n<t` is followed by `<think>` in one and
    # by `<tool_call>` in the other, and the call's text starts at its `<`.
    cut = max(shared.rfind(">"), shared.rfind("\n"), shared.rfind("]")) + 1
    return after[cut:]


def sample_tool() -> dict:
    """The tool the sample call names, as the APIs send tools."""
    return {"type": "function", "function": {"name": SAMPLE_NAME, "description": "a sample",
            "parameters": {"type": "object", "properties": {"corral_sample_argument": {"type": "string", "description": "a sample"}},
                           "required": ["corral_sample_argument"]}}}


def json_prefix(sample: str) -> str | None:
    """The fixed text a template writes before a call's JSON (Ollama's way of finding it), or None when
    the sample holds no JSON object naming SAMPLE_NAME."""
    name_at = sample.find(SAMPLE_NAME)
    if name_at < 0:
        return None
    start = max(sample.rfind("{", 0, name_at), sample.rfind("[", 0, name_at))
    while start > 0 and sample[start - 1] in "[{":
        start -= 1
    if start < 0:
        return None
    # Only the text after the last end of turn belongs to the call (an assistant header may precede it).
    return re.split(r"\n\n|<\|im_start\|>assistant\n|<\|start_header_id\|>assistant<\|end_header_id\|>", sample[:start])[-1].strip()


def choose_parser(sample: str, families: Iterable[type[ToolCallParser]], source: str = "") -> type[ToolCallParser] | None:
    """The family that writes `sample`; else a generic JSON parser with the sample's prefix; else the family whose
    markers the template's `source` names (a template that renders no past calls, yet tells the model how to call);
    else None."""
    families = list(families)
    for family in families:
        if family.recognises(sample):
            return family
    prefix = json_prefix(sample)
    if prefix is not None:
        return _GenericJson.with_prefix(prefix)
    return next((family for family in families if family.recognises(source)), None)


class _GenericJson(JsonToolCallParser):
    family = "json"

    @classmethod
    def with_prefix(cls, prefix: str) -> type[JsonToolCallParser]:
        return type("GenericJsonToolCallParser", (cls,), {"prefix": prefix})


# --- tools and tool_choice -------------------------------------------------------------------


@attrs.frozen
class ToolChoice:
    """A request's tool_choice: "none", "auto", "required", or a function's name (which forces that one)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forces(self) -> bool:
        return self.mode in ("required", "function")


def parse_tools(tools: Any) -> list[dict]:
    """The request's tools, each {"type": "function", "function": {"name", "parameters", ...}}; 400 on a bad shape."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolCallError("tools must be a list of tool objects")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolCallError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolCallError(f"tool {function['name']!r}: parameters must be a JSON schema object")
    return tools


def parse_tool_choice(value: Any, tools: list[dict]) -> ToolChoice:
    """tool_choice as OpenAI sends it (absent means auto when tools are given); 400 on a bad value."""
    names = [tool["function"]["name"] for tool in tools]
    if value is None or value == "auto":
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "required"):
        if value == "required" and not tools:
            raise ToolCallError('tool_choice "required" needs tools')
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in names:
            raise ToolCallError(f"tool_choice names function {name!r}, which is not among the tools")
        return ToolChoice("function", name)
    raise ToolCallError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


# --- choosing a model's parser -----------------------------------------------------------------


def parser_class_for(template: Any, plugins: Any) -> type[ToolCallParser] | None:
    """The parser family for a ChatTemplate, read from its rendering of a sample call; None when it renders none."""
    from corral.template import TemplateError

    def render(messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return template.render(messages, add_generation_prompt=generation_prompt, tools=tools)

    try:
        sample = sample_call_text(render)
    except TemplateError:
        return None
    families = sorted(plugins.tool_parsers().values(), key=lambda family: -getattr(family, "priority", 0))
    return choose_parser(sample, families, template.source)


# --- forcing a call: the grammar of the family's call text -------------------------------------


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def call_schema(tools: list[dict], name_key: str, arguments_key: str) -> dict:
    """The JSON schema of one call object naming one of `tools`, its arguments per that tool's parameters."""
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {name_key: {"const": function["name"]}, arguments_key: parameters},
                        "required": [name_key, arguments_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_call_grammar(parser: type[ToolCallParser], tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for the reply when a call is forced: only calls to `tools`, in the
    family's syntax, each call's arguments valid for its schema; one call unless `parallel`."""
    grammar = getattr(parser, "call_grammar", None)
    if grammar is None:
        raise ToolCallError(f"forcing a tool call is not supported for the {parser.family} tool-call syntax; use tool_choice auto")
    return grammar(tools, parallel)


def lazy_call_grammar(parser: type[ToolCallParser], tools: list[dict], parallel: bool) -> str | None:
    """A Lark grammar that leaves the reply free until the family's prefix, then holds the calls to `tools`'
    schemas; None when the family cannot be constrained this way (no prefix, or not JSON)."""
    grammar = getattr(parser, "call_grammar", None)
    return grammar(tools, parallel, lazy=True) if grammar is not None else None
