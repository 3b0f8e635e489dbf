"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), or
`[TOOL_CALLS]name[ARGS]{...}` per call (the 2025 templates: Mistral Small 3.2, Devstral, Ministral 3)."""

from corral.hookspecs import hookimpl
from corral.toolcalls import JsonToolCallParser, PendingCall, ToolCall, _json_value, written_call


class MistralToolCallParser(JsonToolCallParser):
    family = "mistral"
    prefix = "[TOOL_CALLS]"
    writes_list = True

    @classmethod
    def recognises(cls, sample: str) -> bool:
        return "[TOOL_CALLS]" in sample

    def take_calls(self, text: str, final: bool):
        if text.lstrip()[:1] in ("[", "{") or not text.strip():
            return super().take_calls(text, final) if text.strip() or final else None
        name, sep, rest = text.partition("[ARGS]")
        if not sep:
            return ([], 0) if final or len(name) > 200 else None
        decoded = _json_value(rest, final)
        if decoded is None:
            return None
        arguments, end = decoded
        if end < 0 or not isinstance(arguments, dict):
            return [], 0
        return [ToolCall(name.strip(), arguments, arguments_text=rest[:end].strip())], len(name) + len(sep) + end

    def pending(self) -> PendingCall | None:
        if not self._in_call or self._buffer.lstrip()[:1] in ("[", "{"):
            return super().pending()
        name, sep, rest = self._buffer.partition("[ARGS]")
        if not sep:
            return None
        written = written_call('{"name": "", "arguments": ' + rest.lstrip())  # the same cut as a JSON call's arguments
        return PendingCall(name.strip(), written.arguments) if written is not None else None


@hookimpl
def register_tool_parsers(register):
    register("mistral", MistralToolCallParser)
