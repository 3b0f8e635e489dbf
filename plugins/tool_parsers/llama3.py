"""Llama 3.1 / 3.2 / 3.3: a bare JSON object `{"name": ..., "parameters": {...}}` as the whole reply, or
after `<|python_tag|>`; several calls separated by `;`."""

from corral.hookspecs import hookimpl
from corral.toolcalls import SAMPLE_NAME, JsonToolCallParser, json_prefix


class Llama3ToolCallParser(JsonToolCallParser):
    family = "llama3"
    prefix = ""  # the call is the reply itself
    arguments_key = "parameters"
    alternative_prefixes = ("<|python_tag|>",)

    @classmethod
    def recognises(cls, sample: str) -> bool:
        bare_json = json_prefix(sample) == "" and f'"name": "{SAMPLE_NAME}"' in sample
        return "<|python_tag|>" in sample or bare_json and ("<|eot_id|>" in sample or "<|eom_id|>" in sample)


@hookimpl
def register_tool_parsers(register):
    register("llama3", Llama3ToolCallParser)
