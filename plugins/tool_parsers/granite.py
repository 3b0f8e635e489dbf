"""Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`."""

from corral.hookspecs import hookimpl
from corral.toolcalls import JsonToolCallParser


class GraniteToolCallParser(JsonToolCallParser):
    family = "granite"
    prefix = "<|tool_call|>"
    writes_list = True

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<|tool_call|>" in sample and "<|/tool_call|>" not in sample


@hookimpl
def register_tool_parsers(register):
    register("granite", GraniteToolCallParser)
