"""One path from a generation request to runtime chunks, shared by the Ollama and OpenAI APIs.

It parses tool calls out of a chat's output when the request offers tools (`plan_tools`, `with_tool_calls`;
the syntax is the model's template's, see corral.toolcalls), applies the model's Modelfile defaults (options: request > Modelfile > environment > built-in;
the SYSTEM message and MESSAGES when the request brings none), loads the model through the
scheduler, streams the runtime's chunks, and counts tokens for /metrics.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, AsyncIterator, Callable

import attrs
import trio

from corral.grammar import LARK_KEY
from corral.modelfile.defaults import ModelDefaults, model_defaults
from corral.runner.interface import Runner
from corral.runner.stream import Chunk
from corral.server.http import ApiError
from corral.server.state import model_template_source, state
from corral.template import ChatTemplate
from corral.thinking import OPEN, ThinkingParser, can_think
from corral.toolcalls import (
    Parsed, PendingCall, ToolCall, ToolCallError, ToolCallParser, ToolChoice, forced_call_grammar, lazy_call_grammar, parser_class_for,
)


@attrs.frozen
class Prepared:
    """What a handler's `start` callback gets: the runtime, merged options and the model's defaults."""

    runtime: Runner
    options: dict
    defaults: ModelDefaults

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """The request's messages behind the Modelfile's MESSAGES, with its SYSTEM unless one is given."""
        return self.defaults.chat_messages(messages)


async def chunks(
    model: str, options: dict, keep_alive: Any, start: Callable[[Prepared], contextlib.AbstractAsyncContextManager]
) -> AsyncIterator[Chunk]:
    """The runtime's chunks for one request; the last has `done`."""
    server = state()  # read now: a streamed body runs outside the app context
    arrived = time.perf_counter()
    defaults = await trio.to_thread.run_sync(model_defaults, server.store, model)
    merged = defaults.merge_options(options)
    timer = server.metrics.timer(server.scheduler.resolve(model)[0], arrived) if server.metrics is not None else None
    final = None
    async with server.scheduler.use(model, merged, keep_alive) as loaded:
        async with start(Prepared(loaded.runtime, merged, defaults)) as stream:
            async for chunk in stream:
                if timer is not None:
                    timer.chunk(chunk)
                if chunk.done:
                    if server.metrics is not None:
                        server.metrics.record_generation(chunk.prompt_eval_count, chunk.eval_count)
                    final = chunk
                    break
                yield chunk
    if final is not None:
        # Sent once the model is released: when the client sees the end, a keep_alive of 0 has begun the unload
        # (an /api/ps right after no longer lists the model) and the slot is free for its next request.
        yield final


async def started(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`items` run up to its first item now, so errors before any output get a real status code."""
    first = await items.__anext__()

    async def rest() -> AsyncIterator[Any]:
        async with contextlib.aclosing(items):
            yield first
            async for item in items:
                yield item

    return rest()


# --- tool calls ------------------------------------------------------------------------------------


@attrs.frozen
class ChatChunk(Chunk):
    """A chat chunk whose text is content only: the tool calls completed with it are separate."""

    tool_calls: tuple[ToolCall, ...] = ()
    thinking: str = ""
    pending_call: PendingCall | None = None  # the call being written after this chunk (OpenAI streams its fragments)


@attrs.frozen
class ToolPlan:
    """How one request's tools are handled: the parser family (None: calls are not parsed) and the grammar of a
    forced call (a runtime `format`; None when the model may answer in text)."""

    tools: list[dict]
    parser: type[ToolCallParser] | None
    format: dict | None = None

    def new_parser(self) -> ToolCallParser | None:
        return self.parser(self.tools) if self.parser is not None else None


def _template(name: str) -> ChatTemplate:
    return _compiled(model_template_source(state().store, name))


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> ChatTemplate:
    return ChatTemplate(source)  # compiling a long template takes milliseconds; each request would pay them


def plan_tools(name: str, tools: list[dict], choice: ToolChoice, parallel: bool = True) -> ToolPlan:
    """The plan for `tools` offered to model `name` (400 when the model cannot take tools, or a forced call
    cannot be expressed in its syntax). Blocking: run it in a thread."""
    state().require_capability(name, "tools")
    parser = parser_class_for(_template(name), state().scheduler.plugins)
    if choice.mode == "none":
        return ToolPlan(tools, None)
    if not choice.forces:
        # The model may answer in text; once it opens a call, the call is held to the tools' schemas.
        lazy = lazy_call_grammar(parser, tools, parallel) if parser is not None else None
        return ToolPlan(tools, parser, {LARK_KEY: lazy} if lazy else None)
    if parser is None:
        raise ApiError(400, f'"{name}" has no tool-call syntax corral can read from its template, so a call cannot be forced')
    forced = [tool for tool in tools if choice.name in (None, tool["function"]["name"])]
    try:
        grammar = forced_call_grammar(parser, forced, parallel and choice.name is None)
    except ToolCallError as exc:
        raise ApiError(400, str(exc)) from exc
    return ToolPlan(tools, parser, {LARK_KEY: grammar})


@attrs.frozen
class ThinkPlan:
    """How one request's thinking is handled: split out of the reply or not, and whether the prompt already
    opened the thinking block (DeepSeek R1's generation prompt ends with <think>)."""

    split: bool = False
    thinking_first: bool = False
    channels: type[ToolCallParser] | None = None  # harmony: thinking is a channel, read by this parser


def plan_thinking(name: str, think: bool | str | None, split_by_default: bool) -> ThinkPlan:
    """The plan for `think` on model `name`: 400 when it is asked to think and cannot; thinking is split out when
    asked for, or (`split_by_default`, the OpenAI convention) whenever the model can think. Blocking."""
    template = _template(name)
    able = can_think(template.source)
    if think and not able:
        raise ApiError(400, f'"{name}" does not support thinking')
    if not able or think is False or (think is None and not split_by_default):
        return ThinkPlan()
    user = [{"role": "user", "content": "corral sample question"}]
    opener = template.render(user, add_generation_prompt=True, **({} if think is None else {"think": think}))
    family = parser_class_for(template, state().scheduler.plugins)
    channels = family if getattr(family, "family", "") == "harmony" else None
    return ThinkPlan(True, opener.rstrip().endswith(OPEN), channels)


def with_reasoning(messages: list[dict]) -> list[dict]:
    """Each assistant turn's reasoning under both names templates read: Ollama's `thinking` (Go templates'
    .Thinking) and `reasoning_content` (the DeepSeek / vLLM convention most Jinja templates use)."""
    out = []
    for message in messages:
        reasoning = message.get("thinking") or message.get("reasoning_content")
        if message.get("role") == "assistant" and isinstance(reasoning, str) and reasoning:
            message = {**message, "thinking": reasoning, "reasoning_content": reasoning}
        out.append(message)
    return out


class ReplyParser:
    """A reply's text split into thinking, content and tool calls: the thinking splitter first, then the tool
    parser over the content (harmony's parser reads both from the channels itself)."""

    def __init__(self, tools: ToolCallParser | None, thinking: ThinkingParser | None):
        self.tools = tools
        self.thinking = None if getattr(tools, "family", "") == "harmony" else thinking

    def feed(self, text: str) -> Parsed:
        first = self.thinking.feed(text) if self.thinking else Parsed(text)
        return self._then_tools(first, final=False)

    def finish(self) -> Parsed:
        first = self.thinking.finish() if self.thinking else Parsed()
        return self._then_tools(first, final=True)

    def _then_tools(self, first: Parsed, final: bool) -> Parsed:
        if self.tools is None:
            return first
        second = self.tools.feed(first.content)
        if final:
            second += self.tools.finish()
        return Parsed(second.content, second.calls, first.thinking + second.thinking, self.tools.pending())


def reply_parser(tools: ToolPlan | None, think: ThinkPlan | None) -> ReplyParser | None:
    """The parser for one reply, or None when its text is all content."""
    tool_parser = tools.new_parser() if tools is not None else None
    if tool_parser is None and think is not None and think.channels is not None:
        tool_parser = think.channels([])
    thinking = ThinkingParser(think.thinking_first) if think is not None and think.split else None
    return ReplyParser(tool_parser, thinking) if tool_parser or thinking else None


async def parsed_chunks(items: AsyncIterator[Chunk], parser: ReplyParser | None, pending: bool = False) -> AsyncIterator[Chunk]:
    """`items` with their text split into thinking, content and tool calls (ChatChunks); unchanged without a parser.
    With `pending`, a chunk also comes whenever the call being written grows (its argument fragments)."""
    last = None
    async for chunk in items:
        if parser is None:
            yield chunk
            continue
        parsed = parser.finish() if chunk.done else parser.feed(chunk.text)
        if chunk.done:
            if parsed.content or parsed.calls or parsed.thinking:
                yield ChatChunk(text=parsed.content, tool_calls=parsed.calls, thinking=parsed.thinking)
            yield ChatChunk(**{**attrs.asdict(chunk, recurse=False), "text": ""})
        elif parsed.content or parsed.calls or parsed.thinking or chunk.logprobs or pending and parsed.pending != last:
            fields = {"text": parsed.content, "tool_calls": parsed.calls, "thinking": parsed.thinking, "pending_call": parsed.pending}
            yield ChatChunk(**{**attrs.asdict(chunk, recurse=False), **fields})
        last = parsed.pending


@contextlib.asynccontextmanager
async def parsed_stream(stream_cm: contextlib.AbstractAsyncContextManager, parser: ReplyParser | None, pending: bool = False):
    """A runtime stream (the context manager `Runner.chat` returns) with thinking and tool calls parsed out (and, with
    `pending`, the call being written reported as it grows)."""
    async with stream_cm as stream:
        parsed = parsed_chunks(stream, parser, pending)
        async with contextlib.aclosing(parsed):
            yield parsed
