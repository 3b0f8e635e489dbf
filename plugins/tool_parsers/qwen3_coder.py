"""Qwen3-Coder: XML calls, `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.

A value is text; it is read as JSON when the tool's schema says the parameter is not a string (and it parses).
While a call is written, its arguments stream as the JSON object they will be: each parameter once it is
closed, and a string parameter's text as it is written.
"""

import json
import re

from corral.hookspecs import hookimpl
from corral.grammar import JSON_OPTIONS
from corral.toolcalls import PendingCall, ToolCall, ToolCallParser, calls_grammar, opening_tail

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>)?", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_OPEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_OPEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_VALUE_CLOSE = "\n</parameter>"


class Qwen3CoderToolCallParser(ToolCallParser):
    family = "qwen3-coder"
    prefix = "<tool_call>"
    prefix_is_text = True  # Qwen's <tool_call> is a user-defined token: its text

    @classmethod
    def call_grammar(cls, tools: list[dict], parallel: bool, lazy: bool = False) -> str:
        """Calls to `tools` in the XML the template writes: each parameter of the schema in its order (the required
        ones always), a string's value as text, any other value as JSON valid for the parameter's schema."""
        rules, functions = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            parameters = function.get("parameters") or {}
            required = set(parameters.get("required", ()))
            items = []
            for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
                opening = json.dumps(f"<parameter={key}>\n")
                rules.append(f"p{i}_{j}: {opening} {_value(schema, f'v{i}_{j}', rules)} NL")
                items.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
            opening = json.dumps(f"<function={function['name']}>\n")
            rules.append(f"f{i}: {opening} {' '.join(items)} \"</function>\"")
            functions.append(f"f{i}")
        body = f"NL ({' | '.join(functions)}) NL \"</tool_call>\""
        return calls_grammar(cls.prefix, body, rules, parallel, lazy)

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<tool_call>" in sample and "<function=" in sample

    def take_calls(self, text: str, final: bool):
        match = _FUNCTION.match(text)
        if match is None:
            if final or not "<function=".startswith(text.lstrip()[:10]) and "<function=" not in text:
                return [], 0
            return None
        if not final and "</tool_call>" not in match.group(0) and "</tool_call>".startswith(text[match.end() :].lstrip()):
            return None  # the closing </tool_call> may still come
        name = match.group(1).strip()
        arguments = {key.strip(): self._value(name, key.strip(), value) for key, value in _PARAMETER.findall(match.group(2))}
        return [ToolCall(name, arguments)], match.end()

    def pending(self) -> PendingCall | None:
        """The call being written, once its function is named: its arguments so far as the JSON text the finished
        call serialises to (`ToolCall.arguments_json`), so each step's text begins the next one's."""
        opened = _OPEN_FUNCTION.match(self._buffer) if self._in_call else None
        if opened is None:
            return None
        name, body = opened.group(1).strip(), self._buffer[opened.end() :].split("</function>")[0]
        members, at, seen = [], 0, set()
        while (parameter := _OPEN_PARAMETER.search(body, at)) is not None:
            key, start = parameter.group(1).strip(), parameter.end()
            if key in seen:
                break  # a repeated parameter keeps its first place and its last value: wait for the whole call
            seen.add(key)
            close = body.find("</parameter>", start)
            if close < 0:
                if self._schema_type(name, key) in (None, "string"):  # its text streams as it is written
                    members.append(f"{json.dumps(key, ensure_ascii=False)}: " + _string_so_far(body[start:]))
                break
            value = body[start:close].removeprefix("\n").removesuffix("\n")
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(self._value(name, key, value), ensure_ascii=False)}")
            at = close + len("</parameter>")
        return PendingCall(name, "{" + ", ".join(members))

    def _value(self, function: str, parameter: str, text: str):
        kind = self._schema_type(function, parameter)
        if kind in (None, "string"):
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _schema_type(self, function: str, parameter: str):
        for tool in self.tools:
            if tool.get("function", {}).get("name") == function:
                return tool["function"].get("parameters", {}).get("properties", {}).get(parameter, {}).get("type")
        return None


_VALUE_END = "\n</parameter>"


def _string_so_far(text: str) -> str:
    """A string value being written, as the start of its JSON: the opening quote and the text sure to be part of
    it (not a newline or tag start that may close it)."""
    text = text.removeprefix("\n")
    settled = text[: len(text) - opening_tail(text, (_VALUE_CLOSE, "</parameter>"))]
    return '"' + json.dumps(settled, ensure_ascii=False)[1:-1]


def _value(schema: dict, name: str, rules: list[str]) -> str:
    """The grammar of one parameter's value and the closing tag (a rule named `name` added to `rules` if needed)."""
    if schema.get("type") == "string" and "enum" in schema:
        return "(" + " | ".join(json.dumps(f"{option}{_VALUE_END}") for option in schema["enum"] if isinstance(option, str)) + ")"
    if schema.get("type") == "string":
        # Any text up to the first closing tag, and the tag, as one lexeme (the lexer never guesses where text ends).
        rules.append(f"{name.upper()}: /(?s:.*)\\n<\\/parameter>/ & ~/(?s:.*<\\/parameter>.+)/")
        return name.upper()
    rules.append(f"{name}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    return f"{name} {json.dumps(_VALUE_END)}"


@hookimpl
def register_tool_parsers(register):
    register("qwen3-coder", Qwen3CoderToolCallParser)
