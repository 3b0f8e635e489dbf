"""OpenAI's API: /v1/chat/completions, /v1/completions and /v1/models (/v1/embeddings: embed.py).

Requests are translated into Ollama options and run through the same scheduler and runtime as the
Ollama endpoints; replies take OpenAI's shapes, and streams are server-sent events ending in
`data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import time
from typing import Any, AsyncIterator

import attrs
import quart
import trio

from corral.errors import InvalidModelNameError
from corral.grammar import compile_format
from corral.runner.stream import Chunk, TokenLogprob
from corral.server import generation
from corral.server.http import ApiError, field, read_json, sse_response
from corral.server.ollama import insert_prompt
from corral.server.image_urls import resolve_image_parts
from corral.server.refusals import refuse_fields, refuse_images
from corral.server.state import state
from corral.store import parse_name
from corral.toolcalls import parse_tool_choice, parse_tools

bp = quart.Blueprint("openai", __name__)
log = logging.getLogger(__name__)

FINGERPRINT = "fp_corral"
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@attrs.frozen
class Completion:
    """A validated generation request, whichever endpoint it came in on."""

    model: str
    stream: bool
    include_usage: bool
    options: dict[str, Any]
    logprobs: bool
    top_logprobs: int


def _error_event(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": None, "code": None}}


# The ranges of OpenAI's numeric fields: the handlers check these, and /openapi.json publishes them.
NUMBER_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "frequency_penalty": (-2, 2), "presence_penalty": (-2, 2)}
INTEGER_RANGES = {
    "max_tokens": (1, None), "max_completion_tokens": (1, None), "top_logprobs": (0, MAX_TOP_LOGPROBS),
    "logprobs": (0, MAX_TOP_LOGPROBS),  # /v1/completions' logprobs: how many alternatives (chat's is a boolean)
}  # fmt: skip


def _number(body: dict, name: str, default: float | None = None) -> float | None:
    lo, hi = NUMBER_RANGES[name]
    value = field(body, name, (int, float), default)
    if value is not None and not (math.isfinite(value) and lo <= value <= hi):
        raise ApiError(400, f"{name} must be between {lo:g} and {hi:g}, got {value!r}")
    return value


def _integer(body: dict, name: str, default: int | None = None) -> int | None:
    lo, hi = INTEGER_RANGES[name]
    value = field(body, name, int, default)
    if value is not None and (value < lo or hi is not None and value > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, f"{name} must be an integer {bound}, got {value!r}")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
        raise ApiError(400, "stop must be a string or a list of strings")
    return [item for item in stop if item]  # an empty stop string would end every generation at once


# Sampling fields beyond OpenAI's that vLLM (top_k, min_p, repetition_penalty, ignore_eos) and llama.cpp's server
# (the rest) accept on these routes, passed on as the options of the same names; the options' own checks
# (corral.options, the sampler plugins) make a wrong type or range a 400 that names the field.
PASSED_OPTIONS = (
    "top_k", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "ignore_eos", "logit_bias",
    "mirostat", "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
)  # fmt: skip

# Documented fields (OpenAI's, vLLM's) corral does not do: a 400 unless harmless, never silently dropped.
UNSUPPORTED = {
    "audio": (None, "corral generates text only"),
    "modalities": ((["text"], []), "corral generates text only; send modalities ['text'] or leave it out"),
    "prediction": (None, "corral has no predicted outputs (speculative decoding)"),
    "web_search_options": (None, "corral cannot search the web"),
    "min_tokens": (0, "corral has no minimum length; use ignore_eos with max_tokens"),
    "stop_token_ids": ([], "send stop strings instead"),
    "bad_words": ([], "use logit_bias to ban tokens"),
    "allowed_token_ids": (None, "use logit_bias or response_format to restrict tokens"),
    "use_beam_search": (False, "corral samples one sequence; it has no beam search"),
    "prompt_logprobs": (None, "prompt tokens have no logprobs in corral"),
    "guided_json": (None, "use response_format with a json_schema"),
    "guided_regex": (None, "corral constrains output to JSON only: use response_format"),
    "guided_choice": (None, "corral constrains output to JSON only: use response_format with an enum schema"),
    "guided_grammar": (None, "corral constrains output to JSON only: use response_format"),
}


def _extras(body: dict) -> dict[str, Any]:
    """vLLM's and llama.cpp's sampling extras as options: top_k -1 is vLLM's "off" (0 here); vLLM's
    repetition_penalty covers the whole context, prompt included, as repeat_penalty over repeat_last_n -1."""
    options = {name: body[name] for name in PASSED_OPTIONS if body.get(name) is not None}
    if options.get("top_k") == -1:
        options["top_k"] = 0
    if body.get("repetition_penalty") is not None:
        options["repeat_penalty"] = body["repetition_penalty"]
        options.setdefault("repeat_last_n", -1)
    return options


def _common(body: dict, default_max_tokens: int | None) -> dict[str, Any]:
    """The sampling fields both generation endpoints share, as Ollama options."""
    refuse_fields(body, UNSUPPORTED)
    for name in ("n", "best_of"):
        if field(body, name, int, 1) != 1:
            raise ApiError(400, f"{name} must be 1: corral returns one choice per request")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", default_max_tokens)
    options = {
        # OpenAI's defaults, not Ollama's: an absent temperature or top_p means 1.0.
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "frequency_penalty": _number(body, "frequency_penalty"),
        "presence_penalty": _number(body, "presence_penalty"),
        "seed": field(body, "seed", int),
        "stop": _stop(body),
        "num_predict": max_tokens,
    }
    return {key: value for key, value in options.items() if value is not None} | _extras(body)


def _request(body: dict, options: dict, logprobs: bool, top_logprobs: int) -> Completion:
    stream = field(body, "stream", bool, False)
    stream_options = field(body, "stream_options", dict, {})
    include_usage = field(stream_options, "include_usage", bool, False)
    return Completion(field(body, "model", str, required=True), stream, stream and include_usage, options, logprobs, top_logprobs)


def _usage(final: Chunk) -> dict:
    return {
        "prompt_tokens": final.prompt_eval_count,
        "completion_tokens": final.eval_count,
        "total_tokens": final.prompt_eval_count + final.eval_count,
        "prompt_tokens_details": {"cached_tokens": final.prompt_cached_count},
    }


def _finish_reason(final: Chunk) -> str:
    return "length" if final.done_reason == "length" else "stop"


async def _started(req: Completion, start) -> AsyncIterator[Chunk]:
    """The request's chunks, run up to the first one (errors before any output get a status code)."""
    return await generation.started(generation.chunks(req.model, req.options, None, start))


# --- /v1/chat/completions -------------------------------------------------------------------------


IMAGE_PARTS = ("image_url", "input_image")


def _has_images(messages: list) -> bool:
    """Whether any message carries an image content part."""
    return any(
        isinstance(message, dict) and isinstance(message.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS for part in message["content"])
        for message in messages
    )  # fmt: skip


def _text_content(content: Any) -> str:
    """A message's content: a string, or the text of a list of content parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "message content must be a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, "each content part must be an object with a type")
        if part["type"] in IMAGE_PARTS:
            continue  # taken by `_message` (and refused for the model once it is known, unless it can see)
        if part["type"] != "text":
            raise ApiError(
                400, f"content parts of type {part['type']!r} are not supported: corral takes text (and images for a model that can see)"
            )
        if not isinstance(part.get("text"), str):
            raise ApiError(400, "a text content part needs a string text")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(call: Any) -> dict:
    # Chat templates expect Ollama's shape: arguments as an object, where OpenAI sends a JSON string.
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ApiError(400, "each tool call must be an object with a function")
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def _message(message: Any) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, "each message must be an object with a role")
    out = dict(message)
    # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
    out["role"] = "system" if message["role"] == "developer" else message["role"]
    out["content"] = _text_content(message.get("content"))
    if isinstance(message.get("content"), list):
        parts = [part for part in message["content"] if part["type"] in IMAGE_PARTS]
        if parts:
            out["images"] = parts  # read into bytes by `resolve_image_parts` once the model is known to see
    if message.get("tool_calls") is not None:
        if not isinstance(message["tool_calls"], list):
            raise ApiError(400, "tool_calls must be a list")
        out["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    return out


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _reasoning_effort(body: dict) -> bool | str | None:
    """`reasoning_effort` as a think value: "none" is no thinking, "minimal" the lowest level; absent is None."""
    effort = field(body, "reasoning_effort", str)
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    return False if effort == "none" else "low" if effort == "minimal" else effort


def _name_tool_results(messages: list[dict]) -> list[dict]:
    """Tool results named after the call they answer (OpenAI sends only `tool_call_id`; templates print the
    function's name, which Ollama calls `tool_name`)."""
    names = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            if isinstance(call.get("id"), str):
                names[call["id"]] = call["function"].get("name")
        if message["role"] == "tool" and names.get(message.get("tool_call_id")):
            message.setdefault("name", names[message["tool_call_id"]])
            message.setdefault("tool_name", names[message["tool_call_id"]])
    return messages


def _response_format(body: dict) -> str | dict | None:
    """`response_format` as a runtime format: None (text), "json" (json_object) or the json_schema's schema."""
    response_format = field(body, "response_format", dict)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = field(response_format, "json_schema", dict, required=True)
        schema = field(spec, "schema", dict, {"type": "object"})
        compile_format(schema)  # an unusable schema is a 400 before the model loads
        return schema
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'")


def _chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[dict]:
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "bytes": list(lp.text.encode()),
            "top_logprobs": [{"token": text, "logprob": value, "bytes": list(text.encode())} for _, text, value in lp.top],
        }
        for lp in logprobs
    ]


@bp.post("/v1/chat/completions")
async def chat_completions():
    body = await read_json()
    model = field(body, "model", str, required=True)
    messages = field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "messages must hold at least one message")
    messages = _name_tool_results([_message(message) for message in messages])
    response_format = _response_format(body)
    tools = parse_tools(field(body, "tools", list))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = field(body, "parallel_tool_calls", bool, True)
    think = _reasoning_effort(body)
    logprobs = field(body, "logprobs", bool, False)
    top_logprobs = _integer(body, "top_logprobs", 0)
    if top_logprobs and not logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true")
    req = _request(body, _common(body, None), logprobs, top_logprobs)
    state().scheduler.resolve(model)  # unknown model: 404 before anything loads
    if _has_images(body["messages"]):
        await refuse_images(model)
        messages = [{**m, "images": await resolve_image_parts(m["images"])} if m.get("images") else m for m in messages]
    plan = await trio.to_thread.run_sync(generation.plan_tools, model, tools, choice, parallel) if tools else None
    thinking = await trio.to_thread.run_sync(generation.plan_thinking, model, think, True)
    if plan is not None and choice.forces and response_format is not None:
        raise ApiError(400, "a forced tool call (tool_choice) cannot be combined with response_format")

    def start(run: generation.Prepared):
        stream = run.runtime.chat(
            generation.with_reasoning(run.chat_messages(messages)), run.options, tools=tools or None, logprobs=req.logprobs,
            top_logprobs=req.top_logprobs, format=response_format if response_format is not None or plan is None else plan.format,
            **({} if think is None else {"think": think}),
        )
        return generation.parsed_stream(stream, generation.reply_parser(plan, thinking), pending=req.stream)

    chunks = await _started(req, start)
    reply = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": req.model, "system_fingerprint": FINGERPRINT}
    if req.stream:
        return sse_response(_chat_events(req, reply, chunks, parallel), _error_event)
    text, token_logprobs, calls, reasoning, final = [], [], [], [], None
    async for chunk in chunks:
        text.append(chunk.text)
        reasoning.append(getattr(chunk, "thinking", ""))
        token_logprobs += _chat_logprobs(chunk.logprobs)
        calls += getattr(chunk, "tool_calls", ())
        final = chunk
    calls = calls if parallel else calls[:1]
    message = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [{key: value for key, value in call.openai(i).items() if key != "index"} for i, call in enumerate(calls)]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": token_logprobs, "refusal": None} if req.logprobs else None,
        "finish_reason": "tool_calls" if calls else _finish_reason(final),
    }
    return {**reply, "object": "chat.completion", "choices": [choice], "usage": _usage(final)}


class _ToolCallDeltas:
    """A turn's tool calls as vLLM streams them: for each call its index, id, type and name first (as soon as the
    name is written), then its arguments in fragments as they are generated; `parallel` false keeps the first."""

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self.count = 0  # calls begun
        self.sent = ""  # the begun call's arguments sent so far
        self.open = False  # a call is begun and not yet complete

    def deltas(self, chunk: Chunk) -> list[dict]:
        """The deltas `chunk` adds: the rest of each call it completes, then the head and new text of the one being written."""
        out = []
        for call in getattr(chunk, "tool_calls", ()):
            if self.open:
                out += self._fragment(call.arguments_json())
                self.open = False
            elif self._may_begin():
                out += [self._head(call.name), *self._fragment(call.arguments_json())]
                self.open = False
        pending = getattr(chunk, "pending_call", None)
        if pending is not None and (self.open or self._may_begin()):
            if not self.open:
                out.append(self._head(pending.name))
            out += self._fragment(pending.arguments)
        return out

    def _may_begin(self) -> bool:
        return self.parallel or self.count == 0

    def _head(self, name: str) -> dict:
        self.count += 1
        self.sent, self.open = "", True
        head = {"index": self.count - 1, "id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": ""}}
        return {"tool_calls": [head]}

    def _fragment(self, arguments: str) -> list[dict]:
        if not arguments.startswith(self.sent):
            # The finished call's text is the text written, so this does not happen; the client would see two texts.
            log.warning("tool call arguments %r do not continue the fragments sent (%r)", arguments, self.sent)
            return []
        new, self.sent = arguments[len(self.sent) :], arguments
        return [{"tool_calls": [{"index": self.count - 1, "function": {"arguments": new}}]}] if new else []


async def _chat_events(req: Completion, reply: dict, chunks: AsyncIterator[Chunk], parallel: bool = True) -> AsyncIterator[dict]:
    base = {**reply, "object": "chat.completion.chunk"}
    usage = {"usage": None} if req.include_usage else {}
    calls = _ToolCallDeltas(parallel)

    def event(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}], **usage}

    async with contextlib.aclosing(chunks):
        yield event({"role": "assistant", "content": ""})
        async for chunk in chunks:
            if chunk.done:
                yield event({}, "tool_calls" if calls.count else _finish_reason(chunk))
                if req.include_usage:
                    yield {**base, "choices": [], "usage": _usage(chunk)}
                continue
            if getattr(chunk, "thinking", ""):
                yield event({"reasoning_content": chunk.thinking})
            if chunk.text or (req.logprobs and chunk.logprobs):
                logprobs = {"content": _chat_logprobs(chunk.logprobs), "refusal": None} if req.logprobs else None
                yield event({"content": chunk.text}, logprobs=logprobs)
            for delta in calls.deltas(chunk):
                yield event(delta)


# --- /v1/completions ------------------------------------------------------------------------------


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string or a list of one string")
    return prompt


@attrs.define
class _LegacyLogprobs:
    """The completions endpoint's logprobs: parallel lists, offsets counted in characters of the text."""

    offset: int

    def shape(self, logprobs: tuple[TokenLogprob, ...]) -> dict:
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.text)
        return {
            "tokens": [lp.text for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text: value for _, text, value in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


@bp.post("/v1/completions")
async def completions():
    body = await read_json()
    model = field(body, "model", str, required=True)
    prompt = _prompt(body)
    suffix = field(body, "suffix", str, "")
    echo = field(body, "echo", bool, False)
    top_logprobs = _integer(body, "logprobs")
    if echo and top_logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported yet: prompt tokens have no logprobs")
    req = _request(body, _common(body, COMPLETIONS_DEFAULT_MAX_TOKENS), top_logprobs is not None, top_logprobs or 0)
    state().scheduler.resolve(model)
    # Fill in the middle through the model's template (.Prompt, .Suffix), as Ollama's OpenAI layer does;
    # a model whose template has no suffix answers 400 "does not support insert". `echo` shows the prompt sent.
    rendered = await insert_prompt(model, None, prompt, suffix) if suffix else prompt

    def start(run: generation.Prepared):
        return run.runtime.generate(rendered, run.options, raw=True, logprobs=req.logprobs, top_logprobs=req.top_logprobs)

    chunks = await _started(req, start)
    reply = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
             "model": req.model, "system_fingerprint": FINGERPRINT}
    legacy = _LegacyLogprobs(len(prompt) if echo else 0)
    if req.stream:
        return sse_response(_completion_events(req, reply, chunks, prompt if echo else "", legacy), _error_event)
    text, merged, final = [prompt] if echo else [], [], None
    async for chunk in chunks:
        text.append(chunk.text)
        merged += chunk.logprobs
        final = chunk
    choice = {
        "text": "".join(text),
        "index": 0,
        "logprobs": legacy.shape(tuple(merged)) if req.logprobs else None,
        "finish_reason": _finish_reason(final),
    }
    return {**reply, "choices": [choice], "usage": _usage(final)}


async def _completion_events(
    req: Completion, reply: dict, chunks: AsyncIterator[Chunk], echoed: str, legacy: _LegacyLogprobs
) -> AsyncIterator[dict]:
    usage = {"usage": None} if req.include_usage else {}

    def event(text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return {**reply, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}], **usage}

    async with contextlib.aclosing(chunks):
        if echoed:
            yield event(echoed)
        async for chunk in chunks:
            if chunk.done:
                yield event("", _finish_reason(chunk))
                if req.include_usage:
                    yield {**reply, "choices": [], "usage": _usage(chunk)}
            elif chunk.text or (req.logprobs and chunk.logprobs):
                yield event(chunk.text, logprobs=legacy.shape(chunk.logprobs) if req.logprobs else None)


# --- /v1/models -----------------------------------------------------------------------------------


def _model_object(name: Any, modified: float) -> dict:
    return {"id": str(name), "object": "model", "created": int(modified), "owned_by": name.namespace}


def _list_models() -> list[dict]:
    return [
        _model_object(entry.name, entry.modified_at.timestamp())
        for entry in state().store.list()
        if entry.manifest.model is not None
    ]


def _retrieve_model(model: str) -> dict:
    try:
        name = parse_name(model)
    except InvalidModelNameError:
        name = None  # no model can have this name: answer as for any other absent model
    path = state().store.manifest_path(name) if name is not None else None
    if path is None or not path.is_file():
        raise ApiError(404, f'model "{model}" not found')
    return _model_object(name, path.stat().st_mtime)


@bp.get("/v1/models")
async def list_models():
    return {"object": "list", "data": await trio.to_thread.run_sync(_list_models)}


@bp.get("/v1/models/<path:model>")
async def retrieve_model(model: str):
    return await trio.to_thread.run_sync(_retrieve_model, model)
