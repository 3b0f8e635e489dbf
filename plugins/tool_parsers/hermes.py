"""Hermes / Qwen 2.5 / Qwen 3 / Granite 4: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call."""

from corral.hookspecs import hookimpl
from corral.toolcalls import JsonToolCallParser


class HermesToolCallParser(JsonToolCallParser):
    family = "hermes"
    prefix = "<tool_call>"
    suffix = "</tool_call>"
    prefix_is_text = True  # Qwen's and Hermes' <tool_call> is a user-defined token: its text

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<tool_call>" in sample and "<function=" not in sample


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolCallParser)
