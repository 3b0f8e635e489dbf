"""Ollama's generation endpoints: /api/generate, /api/chat (embeddings: embed.py)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import quart
import trio

from corral.grammar import compile_format
from corral.modelfile.defaults import model_defaults
from corral.runner.stream import Chunk
from corral.scheduler import parse_keep_alive
from corral.server import generation
from corral.server.http import ApiError, field, ndjson_response, now_rfc3339, read_json
from corral.server.refusals import decode_base64_images, refuse_fields, refuse_images
from corral.server.state import state
from corral.gotemplate import OllamaTemplate
from corral.template import ChatTemplate, renders_suffix
from corral.thinking import OPEN, parse_think
from corral.toolcalls import ToolChoice, parse_tools

bp = quart.Blueprint("ollama", __name__)


def _error_line(error: ApiError) -> dict:
    return {"error": error.message}


# Documented fields corral does not do: refused unless harmless (see corral.server.refusals).
UNSUPPORTED = {
    "truncate": (True, "corral always shortens a prompt longer than the context (num_ctx); leave truncate out or true"),
}


def _request_common(body: dict) -> dict[str, Any]:
    """Fields every generation request shares, validated."""
    refuse_fields(body, UNSUPPORTED)
    return {
        "model": field(body, "model", str, required=True),
        "stream": field(body, "stream", bool, True),
        "options": field(body, "options", dict, {}),
        "keep_alive": body.get("keep_alive"),
        "logprobs": field(body, "logprobs", bool, False),
        "top_logprobs": field(body, "top_logprobs", int, 0),
        "shift": field(body, "shift", bool, True),
        "format": _format(body),
    }


def _format(body: dict) -> str | dict | None:
    """The request's `format`: "json" or a JSON-schema object (400 now, before the model loads, if unusable)."""
    value = body.get("format")
    compile_format(value)
    return value


def _metrics(final: Chunk, load_ns: int, started_ns: int) -> dict[str, Any]:
    return {
        "done_reason": final.done_reason,
        "total_duration": time.perf_counter_ns() - started_ns,
        "load_duration": load_ns,
        "prompt_eval_count": final.prompt_eval_count,
        "prompt_eval_duration": final.prompt_eval_duration,
        "eval_count": final.eval_count,
        "eval_duration": final.eval_duration,
    }


def _logprobs(chunk: Chunk) -> list[dict]:
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": text, "logprob": value} for _, text, value in lp.top],
        }
        for lp in chunk.logprobs
    ]


async def _run(req: dict, start, shape_chunk, shape_final) -> AsyncIterator[dict]:
    """Stream the request's chunks as API objects, ending with the metrics."""
    started = time.perf_counter_ns()
    load_ns = 0
    async for chunk in generation.chunks(req["model"], req["options"], req["keep_alive"], start):
        load_ns = load_ns or time.perf_counter_ns() - started  # includes waiting for the model
        if chunk.done:
            yield shape_final(chunk) | _metrics(chunk, load_ns, started)
        else:
            yield shape_chunk(chunk)


async def _respond(req: dict, chunks: AsyncIterator[dict], text_key: tuple[str, ...]) -> quart.Response | dict:
    chunks = await generation.started(chunks)
    if req["stream"]:
        return ndjson_response(chunks, _error_line)
    # Not streaming: one object with the text concatenated and the final metrics.
    text, logprobs, tool_calls, thinking, final = [], [], [], [], {}
    async for item in chunks:
        node = item
        for key in text_key[:-1]:
            node = node.get(key, {})
        text.append(node.get(text_key[-1], ""))
        tool_calls += node.get("tool_calls", [])
        thinking.append(node.get("thinking", ""))
        logprobs += item.get("logprobs", [])
        final = item
    node = final
    for key in text_key[:-1]:
        node = node.setdefault(key, {})
    node[text_key[-1]] = "".join(text)
    if tool_calls:
        node["tool_calls"] = tool_calls
    if "".join(thinking):
        node["thinking"] = "".join(thinking)
    if req["logprobs"]:
        final["logprobs"] = logprobs
    return final


async def _load_or_unload(req: dict, base: dict) -> dict:
    """An empty prompt: load the model (done_reason "load"), or unload it when keep_alive is 0."""
    scheduler = state().scheduler
    scheduler.resolve(req["model"])
    if parse_keep_alive(req["keep_alive"]) == 0:
        await scheduler.unload(req["model"])
        return base | {"done": True, "done_reason": "unload"}
    # Loaded with the same options a generation would use, so the next request does not reload.
    defaults = await trio.to_thread.run_sync(model_defaults, state().store, req["model"])
    async with scheduler.use(req["model"], defaults.merge_options(req["options"]), req["keep_alive"]):
        pass
    return base | {"done": True, "done_reason": "load"}


async def insert_prompt(model: str, source: str | None, prompt: str, suffix: str) -> str:
    """Fill in the middle, as Ollama renders it: the template (the request's, else the model's) over .Prompt and
    .Suffix; 400 when it has no .Suffix (the model does not support insert)."""
    defaults = await trio.to_thread.run_sync(model_defaults, state().store, model)
    source = source or defaults.template or ""
    if not renders_suffix(source):
        raise ApiError(400, f"{model} does not support insert")
    return OllamaTemplate(source).render(prompt=prompt, suffix=suffix)


async def _templated_prompt(model: str, source: str | None, prompt: str, suffix: str, system: str | None, context: list | None) -> str:
    """The prompt Ollama renders itself before sending it raw: with a `suffix`, the template's fill-in-the-middle
    form (.Prompt, .Suffix); else the request's template over the system message (the request's, else the
    model's), the model's MESSAGEs unless a `context` continues a conversation, and the prompt as the user's turn."""
    if suffix:
        return await insert_prompt(model, source, prompt, suffix)
    defaults = await trio.to_thread.run_sync(model_defaults, state().store, model)
    template = ChatTemplate(source)  # a template that does not compile is a TemplateError: 400
    system = system or defaults.system
    messages = [{"role": "system", "content": system}] if system else []
    if context is None:
        messages += [message.to_json() for message in defaults.messages]
    return template.render(messages + [{"role": "user", "content": prompt}])


@bp.post("/api/generate")
async def generate():
    body = await read_json()
    req = _request_common(body)
    prompt = field(body, "prompt", str, "")
    raw = field(body, "raw", bool, False)
    system = field(body, "system", str, None)
    context = field(body, "context", list, None)
    if raw and (system or context or body.get("template")):
        raise ApiError(400, "raw mode does not support template, system, or context")
    template = field(body, "template", str, None)
    suffix = field(body, "suffix", str, "")
    think = parse_think(body.get("think"))
    images = decode_base64_images(field(body, "images", list, []))
    state().scheduler.resolve(req["model"])
    if images:
        await refuse_images(req["model"])
    base = {"model": req["model"], "created_at": now_rfc3339(), "response": ""}
    if not prompt and not images:
        return await _load_or_unload(req, base)
    templated = bool(template or suffix) and not raw
    if templated:
        # As Ollama: a request's template or a suffix renders the prompt here, which then goes to the model raw.
        prompt = await _templated_prompt(req["model"], template, prompt, suffix, system, context)
    # As Ollama: `think` sets the template's switch and splits the reply's thinking out (400 for a model that cannot think).
    thinking = await trio.to_thread.run_sync(generation.plan_thinking, req["model"], think, False) if think is not None else None
    if thinking is not None and thinking.split and (raw or templated):
        thinking = generation.ThinkPlan(True, prompt.rstrip().endswith(OPEN))  # the prompt as sent, not the model's template

    def start(run: generation.Prepared):
        stream = run.runtime.generate(
            prompt, run.options, raw=raw or templated, system=None if templated else system or (None if raw else run.defaults.system),
            context=context, shift=req["shift"], logprobs=req["logprobs"], top_logprobs=req["top_logprobs"], format=req["format"],
            **({"images": images} if images else {}),
            **({} if think is None else {"think": think}),
        )  # fmt: skip
        return generation.parsed_stream(stream, generation.reply_parser(None, thinking))

    def chunk_obj(chunk: Chunk) -> dict:
        out = {"model": req["model"], "created_at": now_rfc3339(), "response": chunk.text, "done": False}
        if getattr(chunk, "thinking", ""):
            out["thinking"] = chunk.thinking
        return out | ({"logprobs": _logprobs(chunk)} if chunk.logprobs else {})

    def final_obj(chunk: Chunk) -> dict:
        out = {"model": req["model"], "created_at": now_rfc3339(), "response": "", "done": True}
        return out if raw else out | {"context": list(chunk.context)}

    return await _respond(req, _run(req, start, chunk_obj, final_obj), ("response",))


@bp.post("/api/chat")
async def chat():
    body = await read_json()
    req = _request_common(body)
    messages = field(body, "messages", list, [])
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a role")
        if not isinstance(message.get("content", ""), str):
            raise ApiError(400, "message content must be a string")
    messages = [{**m, "images": decode_base64_images(m["images"], "message images")} if m.get("images") else m for m in messages]
    state().scheduler.resolve(req["model"])
    if any(message.get("images") for message in messages):
        await refuse_images(req["model"])
    base = {"model": req["model"], "created_at": now_rfc3339(), "message": {"role": "assistant", "content": ""}}
    if not messages:
        return await _load_or_unload(req, base)
    tools = parse_tools(body.get("tools"))  # a bad shape is a ToolCallError: 400
    think = parse_think(body.get("think"))
    plan = await trio.to_thread.run_sync(generation.plan_tools, req["model"], tools, ToolChoice()) if tools else None
    thinking = await trio.to_thread.run_sync(generation.plan_thinking, req["model"], think, False) if think is not None else None
    calls = _CallCounter()

    def start(run: generation.Prepared):
        stream = run.runtime.chat(
            generation.with_reasoning(run.chat_messages(messages)), run.options, tools=tools or None, shift=req["shift"],
            logprobs=req["logprobs"], top_logprobs=req["top_logprobs"],
            format=req["format"] if req["format"] or plan is None else plan.format, **({} if think is None else {"think": think}),
        )
        return generation.parsed_stream(stream, generation.reply_parser(plan, thinking))

    def chunk_obj(chunk: Chunk) -> dict:
        message = {"role": "assistant", "content": chunk.text} | calls.shape(getattr(chunk, "tool_calls", ()))
        if getattr(chunk, "thinking", ""):
            message["thinking"] = chunk.thinking
        out = {"model": req["model"], "created_at": now_rfc3339(), "message": message, "done": False}
        return out | ({"logprobs": _logprobs(chunk)} if chunk.logprobs else {})

    def final_obj(chunk: Chunk) -> dict:
        return {"model": req["model"], "created_at": now_rfc3339(), "message": {"role": "assistant", "content": ""}, "done": True}

    return await _respond(req, _run(req, start, chunk_obj, final_obj), ("message", "content"))


class _CallCounter:
    """Numbers a turn's tool calls in Ollama's shape (`function.index` counts calls across the stream)."""

    def __init__(self):
        self.count = 0

    def shape(self, calls) -> dict:
        if not calls:
            return {}
        shaped = [call.ollama(self.count + i) for i, call in enumerate(calls)]
        self.count += len(calls)
        return {"tool_calls": shaped}

