"""Phi-4 (mini): `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`."""

from corral.hookspecs import hookimpl
from corral.toolcalls import JsonToolCallParser


class Phi4ToolCallParser(JsonToolCallParser):
    family = "phi4"
    prefix = "<|tool_call|>"
    writes_list = True
    suffix = "<|/tool_call|>"

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<|tool_call|>" in sample and "<|/tool_call|>" in sample


@hookimpl
def register_tool_parsers(register):
    register("phi4", Phi4ToolCallParser)
