"""gpt-oss (OpenAI's harmony format): the reply is messages on channels,
`<|channel|>analysis<|message|>...<|end|>` (reasoning), `<|channel|>final<|message|>...<|return|>` (the answer),
and a call as `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`
(the recipient may also stand before the channel). Headers are dropped; analysis becomes thinking."""

import json
import re

from corral.grammar import JSON_OPTIONS
from corral.hookspecs import hookimpl
from corral.toolcalls import Parsed, PendingCall, ToolCall, ToolCallParser, calls_grammar

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyToolCallParser(ToolCallParser):
    family = "harmony"
    prefix = "to=functions."

    def __init__(self, tools=None):
        super().__init__(tools)
        self._header: str | None = ""  # None while in a message's body
        self._channel = "final"
        self._recipient: str | None = None
        self._body = ""

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "<|channel|>" in sample and "to=functions." in sample

    @classmethod
    def call_grammar(cls, tools: list[dict], parallel: bool, lazy: bool = False) -> str | None:
        """Calls to `tools` as commentary messages to `functions.NAME`, each ending in <|call|>; several calls are
        several assistant messages."""
        if lazy:
            return None  # the headers are control tokens, which free text cannot reach
        rules, calls = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = {**(function.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
            head = f"<|channel|>commentary to=functions.{function['name']} <|constrain|>json{MESSAGE}"
            rules += [f"a{i}: %json {json.dumps(schema)}", f"c{i}: {json.dumps(head)} a{i} \"<|call|>\""]
            calls.append(f"c{i}")
        return calls_grammar("", f"({' | '.join(calls)})", rules, parallel, separator='"<|start|>assistant"')

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> Parsed:
        return self._step(final=True)

    def _step(self, final: bool) -> Parsed:
        out = Parsed()
        while self._buffer:
            if self._header is not None:
                self._header += self._buffer
                self._buffer = ""
                lead = self._header.lstrip()[:2]
                if lead and not "<|".startswith(lead):
                    self._buffer, self._header = self._header, None  # plain text: the answer itself
                    self._channel, self._recipient = "final", None
                    continue
                head, found, rest = self._header.partition(MESSAGE)
                if not found:
                    break
                channel = _CHANNEL.search(head)
                recipient = _RECIPIENT.search(head)
                self._channel = channel.group(1) if channel else "final"
                self._recipient = recipient.group(1) if recipient else None
                self._header, self._buffer, self._body = None, rest, ""
                continue
            ends = [(self._buffer.find(end), end) for end in ENDS if end in self._buffer]
            if ends:
                at, end = min(ends)
                out += self._emit(self._buffer[:at], done=True)
                self._buffer, self._header = self._buffer[at + len(end) :], ""
                continue
            keep = 0 if final else next((n for n in range(min(len(self._buffer), 9), 0, -1)
                                         if any(e.startswith(self._buffer[-n:]) for e in ENDS)), 0)
            piece, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
            out += self._emit(piece, done=final)
            break
        if final and self._header is None and self._recipient is not None and self._body:
            out += self._emit("", done=True)
        return out

    def pending(self) -> PendingCall | None:
        if self._header is None and self._recipient is not None:
            return PendingCall(self._recipient, self._body)
        return None

    def _emit(self, text: str, done: bool) -> Parsed:
        if self._recipient is None:
            return Parsed(thinking=text) if self._channel == "analysis" else Parsed(text)
        self._body += text
        if not done:
            return Parsed()
        body, self._body, name, self._recipient = self._body, "", self._recipient, None
        try:
            arguments = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError:
            return Parsed(body)
        if not isinstance(arguments, dict):
            return Parsed(body)
        return Parsed(calls=(ToolCall(name, arguments, arguments_text=body if body.strip() else None),))


@hookimpl
def register_tool_parsers(register):
    register("harmony", HarmonyToolCallParser)
