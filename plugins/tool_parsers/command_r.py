"""Command-R: R7B writes `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`;
Command-R+ writes `Action: ```json [...] ```` with the same objects."""

import re

from corral.hookspecs import hookimpl
from corral.toolcalls import JsonToolCallParser


class CommandRToolCallParser(JsonToolCallParser):
    family = "command-r"
    prefix = "<|START_ACTION|>"
    suffix = "<|END_ACTION|>"
    name_key = "tool_name"
    arguments_key = "parameters"
    writes_list = True

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<|START_ACTION|>" in sample


class CommandRPlusToolCallParser(JsonToolCallParser):
    family = "command-r-plus"
    prefix = "Action:"
    suffix = "```"
    name_key = "tool_name"
    arguments_key = "parameters"
    writes_list = True
    fence = "```json"

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return re.search(r"Action:\s*```json", sample) is not None

    def take_calls(self, text: str, final: bool):
        stripped = text.lstrip()
        if not final and self.fence.startswith(stripped):
            return None
        if not stripped.startswith(self.fence):
            return [], 0
        lead = len(text) - len(stripped) + len(self.fence)
        taken = super().take_calls(text[lead:], final)
        if taken is None or not taken[0]:
            return taken
        return taken[0], lead + taken[1]


@hookimpl
def register_tool_parsers(register):
    register("command-r", CommandRToolCallParser)
    register("command-r-plus", CommandRPlusToolCallParser)
