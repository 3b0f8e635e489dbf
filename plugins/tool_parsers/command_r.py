"""Command-R: R7B writes `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`;
Command-R+ writes `Action: ```json [...] ```` with the same objects."""

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
    prefix = "Action: ```json"
    suffix = "```"
    name_key = "tool_name"
    arguments_key = "parameters"
    writes_list = True

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "Action: ```json" in sample


@hookimpl
def register_tool_parsers(register):
    register("command-r", CommandRToolCallParser)
    register("command-r-plus", CommandRPlusToolCallParser)
