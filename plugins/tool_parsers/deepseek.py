"""DeepSeek V3 / R1 and V3.1+: calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>` (V3, R1) or
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (V3.1 and later)."""

import json
import re

from corral.hookspecs import hookimpl
from corral.toolcalls import ToolCall, ToolCallParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCED = re.compile(r"^\s*function\s*$")


class DeepSeekToolCallParser(ToolCallParser):
    family = "deepseek"
    prefix = CALLS_BEGIN

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return CALLS_BEGIN in sample or CALL_BEGIN in sample

    def take_calls(self, text: str, final: bool):
        end = text.find(CALLS_END)
        if end < 0:
            return ([], 0) if final else None
        calls = [self._call(body) for body in text[:end].split(CALL_BEGIN) if body.strip()]
        if None in calls or not calls:
            return [], 0
        return calls, end + len(CALLS_END)

    @staticmethod
    def _call(body: str):
        body = body.split(CALL_END)[0]
        head, sep, args = body.partition(SEP)
        if not sep:
            return None
        if _FENCED.match(head):  # V3 / R1: the name on the first line, then a fenced JSON block
            name, _, args = args.partition("\n")
            args = args.strip().removeprefix("```json").removesuffix("```")
        else:
            name = head
        try:
            arguments = json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(name.strip(), arguments) if isinstance(arguments, dict) else None


@hookimpl
def register_tool_parsers(register):
    register("deepseek", DeepSeekToolCallParser)
