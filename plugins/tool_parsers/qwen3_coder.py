"""Qwen3-Coder: XML calls, `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.

A value is text; it is read as JSON when the tool's schema says the parameter is not a string (and it parses).
"""

import json
import re

from corral.hookspecs import hookimpl
from corral.toolcalls import ToolCall, ToolCallParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>)?", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderToolCallParser(ToolCallParser):
    family = "qwen3-coder"
    prefix = "<tool_call>"

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


@hookimpl
def register_tool_parsers(register):
    register("qwen3-coder", Qwen3CoderToolCallParser)
