"""DeepSeek V3 / R1 and V3.1+: calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>` (V3, R1) or
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (V3.1 and later)."""

import json
import re

from corral.grammar import JSON_OPTIONS
from corral.hookspecs import hookimpl
from corral.toolcalls import PendingCall, ToolCall, ToolCallParser, calls_grammar, settled_arguments

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCED = re.compile(r"^\s*function\s*$")


class DeepSeekToolCallParser(ToolCallParser):
    """V3.1 and later (and any DeepSeek template not writing V3's fenced form)."""

    family = "deepseek"
    prefix = CALLS_BEGIN

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return CALLS_BEGIN in sample or CALL_BEGIN in sample

    @classmethod
    def call_grammar(cls, tools: list[dict], parallel: bool, lazy: bool = False) -> str | None:
        """Calls to `tools` between the calls markers, each call's arguments valid for its schema."""
        if lazy:
            return None  # the markers are control tokens, no text free text could reach
        rules, calls = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = {**(function.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
            rules.append(f"a{i}: %json {json.dumps(schema)}")
            head, tail = cls.call_text(function["name"])
            rules.append(f"c{i}: {json.dumps(head)} a{i} {json.dumps(tail)}")
            calls.append(f"c{i}")
        call = f"({' | '.join(calls)})"
        return calls_grammar(cls.prefix, f"{call}{'+' if parallel else ''} {json.dumps(CALLS_END)}", rules, parallel=False)

    @staticmethod
    def call_text(name: str) -> tuple[str, str]:
        """The text of one call before and after its arguments."""
        return f"{CALL_BEGIN}{name}{SEP}", CALL_END

    def take_calls(self, text: str, final: bool):
        end = text.find(CALLS_END)
        if end < 0:
            return ([], 0) if final else None
        calls = [self._call(body) for body in text[:end].split(CALL_BEGIN) if body.strip()]
        if None in calls or not calls:
            return [], 0
        return calls, end + len(CALLS_END)

    def pending(self) -> PendingCall | None:
        """The first call of the block once its name is written, with its arguments so far (streamed as written)."""
        if not self._in_call:
            return None
        first = self._buffer.split(CALLS_END)[0].split(CALL_BEGIN)
        if len(first) < 2:
            return None
        head, sep, args = first[1].partition(SEP)
        if not sep:
            return None
        fenced = _FENCED.match(head) is not None
        if fenced:
            name, newline, args = args.partition("\n")
            args = args.lstrip()
            if not newline or not args.startswith("```json"):
                return None
            args = args.removeprefix("```json")
        else:
            name = head
        closers = (CALL_END, "```") if fenced else (CALL_END,)
        return PendingCall(name.strip(), settled_arguments(args.split(CALL_END)[0], closers))

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
        # The arguments' text as written: what `pending` streamed grows into it.
        return ToolCall(name.strip(), arguments, arguments_text=args.strip()) if isinstance(arguments, dict) else None


class DeepSeekV3ToolCallParser(DeepSeekToolCallParser):
    """V3 and R1: `function<｜tool▁sep｜>NAME` and the arguments in a fenced JSON block."""

    priority = 1  # asked before the general class, whose recognises() also matches this syntax

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return f"{CALL_BEGIN}function{SEP}" in sample

    @staticmethod
    def call_text(name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n", f"\n```{CALL_END}"


@hookimpl
def register_tool_parsers(register):
    register("deepseek-v3", DeepSeekV3ToolCallParser)
    register("deepseek", DeepSeekToolCallParser)
