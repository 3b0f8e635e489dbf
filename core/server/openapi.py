"""The OpenAPI 3.1 document of the whole API: paths and methods from the app's url_map, schemas written here.

Every route the app has is listed, so nothing registered can be missed; a route with no written
operation below is still listed, tagged "undocumented" (a test fails on that tag).
"""

from __future__ import annotations

import re
from typing import Any

import quart

import corral
from corral.options import options_schema
from corral.server.openai import INTEGER_RANGES, MAX_TOP_LOGPROBS, NUMBER_RANGES, PASSED_OPTIONS
from corral.store import name_pattern

_RULE_ARGUMENT = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")  # <path:model> -> model
UNDOCUMENTED = "undocumented"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


def _object(properties: dict, required: tuple[str, ...] = (), **extra: Any) -> dict:
    out = {"type": "object", "properties": properties} | extra
    return out | ({"required": list(required)} if required else {})


_STR, _INT, _NUM, _BOOL = ({"type": t} for t in ("string", "integer", "number", "boolean"))
_TIME = {"type": "string", "format": "date-time"}
_MODEL = _STR | {"pattern": name_pattern(), "description": "[host/][namespace/]model[:tag]"}  # what the store accepts


def _ranged(kind: dict, lo: float | None, hi: float | None) -> dict:
    return kind | ({"minimum": lo} if lo is not None else {}) | ({"maximum": hi} if hi is not None else {})


# --- schemas --------------------------------------------------------------------------------
# Options and the OpenAI sampling fields come from the declarations the handlers check against
# (corral.options, the sampler plugins' `options`, corral.server.openai's ranges): one source of truth.
_OPTIONS = options_schema()  # the installed samplers' options are added per document (`document`)
_IMAGES = _array(_STR) | {"description": "Refused with 400 unless the model can see; no model corral runs can yet"}
_TIMINGS = {
    "done_reason": _STR, "total_duration": _INT, "load_duration": _INT, "prompt_eval_count": _INT,
    "prompt_eval_duration": _INT, "eval_count": _INT, "eval_duration": _INT,
}
_GENERATION_COMMON = {
    "model": _MODEL, "stream": _BOOL | {"default": True}, "options": _ref("Options"), "keep_alive": _ref("KeepAlive"),
    "logprobs": _BOOL, "top_logprobs": _ranged(_INT, 0, MAX_TOP_LOGPROBS), "shift": _BOOL | {"default": True},
    "format": {"description": "\"json\" or a JSON schema"}, "think": {"type": ["boolean", "string"]},
    "truncate": _BOOL | {"const": True, "description": "false is refused: corral always shortens a prompt longer than the context"},
}
_MESSAGE = _object(
    {"role": _STR, "content": _STR, "images": _IMAGES, "tool_calls": _array({"type": "object"}), "thinking": _STR},
    ("role",),
)
_DETAILS = _object(
    {"parent_model": _STR, "format": _STR, "family": _STR, "families": _array(_STR), "parameter_size": _STR,
     "quantization_level": _STR}
)
_MODEL_ENTRY = _object(
    {"name": _STR, "model": _STR, "modified_at": _TIME, "size": _INT, "digest": _STR, "details": _ref("ModelDetails")}
)
_PROGRESS = _object({"status": _STR, "digest": _STR, "total": _INT, "completed": _INT, "error": _STR})
_OPENAI_MESSAGE = _object(
    {"role": _STR,
     "content": {"type": ["string", "array", "null"],
                 "description": "A string or text parts; image parts are refused with 400 unless the model can see"},
     "name": _STR, "tool_calls": _array({"type": "object"}),
     "tool_call_id": _STR, "reasoning_content": _STR},
    ("role",),
)



_OPENAI_SAMPLING = {
    "model": _MODEL, "stream": _BOOL, "stream_options": _object({"include_usage": _BOOL}), "seed": _INT,
    "stop": {"type": ["string", "array"], "items": _STR}, "logprobs": _BOOL,
    "n": _INT | {"const": 1}, "best_of": _INT | {"const": 1},
    "modalities": _array({"const": "text"}), "min_tokens": _INT | {"const": 0},
} | {name: _ranged(_NUM, *bounds) for name, bounds in NUMBER_RANGES.items()} | {
    name: _ranged(_INT, *bounds) for name, bounds in INTEGER_RANGES.items() if name != "logprobs"
}  # fmt: skip


def openai_sampling_extras(options: dict) -> dict:
    """vLLM's and llama.cpp's sampling fields, passed on as the options of the same names (`options`: the
    Options schema's properties): top_k also takes vLLM's -1 (off); repetition_penalty is repeat_penalty's range."""
    extras = {name: options[name] for name in PASSED_OPTIONS if name in options}
    extras["top_k"] = options["top_k"] | {"minimum": -1, "description": "0 or -1: off"}
    extras["repetition_penalty"] = options["repeat_penalty"] | {"description": "vLLM's: over the whole context"}
    return extras
_USAGE = _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT})

SCHEMAS: dict[str, dict] = {
    "Error": _object({"error": _STR}, ("error",)),
    "OpenAIError": _object(
        {"error": _object({"message": _STR, "type": _STR, "param": {"type": ["string", "null"]}, "code": {}}, ("message",))},
        ("error",),
    ),
    "Options": _OPTIONS,
    "KeepAlive": {"type": ["string", "number"], "description": "Seconds, or a duration like \"5m\"; negative keeps the model loaded"},
    "TokenLogprob": _object(
        {"token": _STR, "logprob": _NUM, "top_logprobs": _array(_object({"token": _STR, "logprob": _NUM}))}
    ),
    "GenerateRequest": _object(
        _GENERATION_COMMON
        | {"prompt": _STR, "suffix": _STR, "system": _STR, "template": _STR, "raw": _BOOL, "context": _array(_INT),
           "images": _IMAGES},
        ("model",),
        description="An empty prompt loads the model (or unloads it with keep_alive 0).",
    ),
    "GenerateResponse": _object(
        {"model": _STR, "created_at": _TIME, "response": _STR, "thinking": _STR, "done": _BOOL, "context": _array(_INT),
         "logprobs": _array(_ref("TokenLogprob"))} | _TIMINGS,
        ("model", "created_at", "response", "done"),
        description="One NDJSON line when streaming; the last one has done=true and the timings.",
    ),
    "Message": _MESSAGE,
    "ChatRequest": _object(
        _GENERATION_COMMON | {"messages": _array(_ref("Message")), "tools": _array({"type": "object"})},
        ("model",),
        description="No messages loads the model (or unloads it with keep_alive 0).",
    ),
    "ChatResponse": _object(
        {"model": _STR, "created_at": _TIME, "message": _ref("Message"), "done": _BOOL,
         "logprobs": _array(_ref("TokenLogprob"))} | _TIMINGS,
        ("model", "created_at", "message", "done"),
    ),
    "EmbedRequest": _object(
        {"model": _MODEL, "input": {"type": ["string", "array"], "items": _STR}, "truncate": _BOOL, "dimensions": _INT,
         "options": _ref("Options"), "keep_alive": _ref("KeepAlive")},
        ("model",),
    ),
    "EmbedResponse": _object(
        {"model": _STR, "embeddings": _array(_array(_NUM)), "total_duration": _INT, "load_duration": _INT,
         "prompt_eval_count": _INT}
    ),
    "EmbeddingsRequest": _object(
        {"model": _MODEL, "prompt": _STR, "options": _ref("Options"), "keep_alive": _ref("KeepAlive")}, ("model",)
    ),
    "EmbeddingsResponse": _object({"embedding": _array(_NUM)}),
    "ModelDetails": _DETAILS,
    "ModelEntry": _MODEL_ENTRY,
    "TagsResponse": _object({"models": _array(_ref("ModelEntry"))}, ("models",)),
    "ModelRequest": _object({"model": _MODEL, "name": _STR | {"deprecated": True}}),
    "ShowRequest": _object({"model": _MODEL, "name": _STR | {"deprecated": True}, "verbose": _BOOL}),
    "ShowResponse": _object(
        {"license": _STR, "modelfile": _STR, "parameters": _STR, "template": _STR, "details": _ref("ModelDetails"),
         "model_info": {"type": "object", "additionalProperties": True}, "capabilities": _array(_STR),
         "modified_at": _TIME,
         "tensors": _array(_object({"name": _STR, "type": _STR, "shape": _array(_INT)}))}
    ),
    "RunningModel": _object(
        _MODEL_ENTRY["properties"] | {"size_vram": _INT, "expires_at": _TIME, "context_length": _INT}
    ),
    "PsResponse": _object({"models": _array(_ref("RunningModel"))}, ("models",)),
    "CreateRequest": _object(
        {"model": _MODEL, "from": _STR, "files": {"type": "object", "additionalProperties": _STR}, "adapters": {"type": "object"},
         "template": _STR, "license": {"type": ["string", "array"]}, "system": _STR, "parameters": {"type": "object"},
         "messages": _array(_ref("Message")), "quantize": _STR, "stream": _BOOL | {"default": True}},
        ("model",),
    ),
    "CopyRequest": _object({"source": _MODEL, "destination": _MODEL}, ("source", "destination")),
    "PullRequest": _object(
        {"model": _MODEL, "name": _STR | {"deprecated": True}, "insecure": _BOOL, "stream": _BOOL | {"default": True}}
    ),
    "Progress": _PROGRESS,
    "VersionResponse": _object({"version": _STR}, ("version",)),
    "Health": _object({"status": {"const": "ok"}, "models_loaded": _INT}, ("status", "models_loaded")),
    "TokenizeRequest": _object(
        {"model": _MODEL, "content": _STR, "text": _STR | {"description": "alias of content"},
         "prompt": _STR | {"description": "alias of content"}, "add_special": _BOOL | {"default": True},
         "keep_alive": _ref("KeepAlive")},
        ("model",),
    ),
    "TokenizeResponse": _object({"tokens": _array(_INT)}, ("tokens",)),
    "DetokenizeRequest": _object({"model": _MODEL, "tokens": _array(_INT), "keep_alive": _ref("KeepAlive")}, ("model", "tokens")),
    "DetokenizeResponse": _object({"content": _STR}, ("content",)),
    "OpenAIMessage": _OPENAI_MESSAGE,
    "ChatCompletionRequest": _object(
        _OPENAI_SAMPLING
        | {"messages": _array(_ref("OpenAIMessage")), "tools": _array({"type": "object"}), "tool_choice": {},
           "parallel_tool_calls": _BOOL, "reasoning_effort": {"enum": ["none", "minimal", "low", "medium", "high"]},
           "response_format": {"type": "object"}},
        ("model", "messages"),
    ),
    "ChatCompletion": _object(
        {"id": _STR, "object": _STR, "created": _INT, "model": _STR, "system_fingerprint": _STR,
         "choices": _array(_object({"index": _INT, "message": _ref("OpenAIMessage"), "delta": _ref("OpenAIMessage"),
                                    "finish_reason": {"type": ["string", "null"]}, "logprobs": {"type": ["object", "null"]}})),
         "usage": _USAGE},
        ("id", "object", "created", "model", "choices"),
        description="With stream=true, SSE events of chat.completion.chunk objects (choices carry delta), then [DONE].",
    ),
    "CompletionRequest": _object(
        _OPENAI_SAMPLING
        | {"prompt": {"type": ["string", "array"]}, "echo": _BOOL, "logprobs": _ranged(_INT, *INTEGER_RANGES["logprobs"]),
           "suffix": _STR | {"description": "Fill in the middle through the model's template (.Suffix); 400 when it has none"}},
        ("model", "prompt"),
    ),
    "Completion": _object(
        {"id": _STR, "object": _STR, "created": _INT, "model": _STR, "system_fingerprint": _STR,
         "choices": _array(_object({"index": _INT, "text": _STR, "finish_reason": {"type": ["string", "null"]},
                                    "logprobs": {"type": ["object", "null"]}})),
         "usage": _USAGE},
        ("id", "object", "created", "model", "choices"),
    ),
    "OpenAIEmbeddingsRequest": _object(
        {"model": _MODEL, "input": {"type": ["string", "array"]}, "encoding_format": {"enum": ["float", "base64"]},
         "dimensions": _INT},
        ("model", "input"),
    ),
    "OpenAIEmbeddings": _object(
        {"object": {"const": "list"}, "model": _STR,
         "data": _array(_object({"object": _STR, "index": _INT, "embedding": {"type": ["array", "string"]}})),
         "usage": _object({"prompt_tokens": _INT, "total_tokens": _INT})}
    ),
    "OpenAIModel": _object({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR},
                           ("id", "object")),
    "OpenAIModelList": _object({"object": {"const": "list"}, "data": _array(_ref("OpenAIModel"))}, ("object", "data")),
}


# --- operations -------------------------------------------------------------------------------
def _json(schema: str) -> dict:
    return {"application/json": {"schema": _ref(schema)}}


def _error_responses(statuses: tuple[int, ...], openai: bool) -> dict:
    # Every route may refuse a foreign Origin or Host (403) and, with CORRAL_API_KEY set, a missing key (401).
    return {str(status): {"description": _REASONS[status], "content": _json("OpenAIError" if openai else "Error")}
            for status in (*statuses, 401, 403)}


_REASONS = {
    400: "Bad request", 401: "Missing or wrong API key (CORRAL_API_KEY)", 403: "Origin or Host not allowed",
    404: "Model not found", 500: "Server error",
    502: "The model registry failed or sent something refused", 503: "Server busy",
    507: "The disk holding the model store is full (nothing was kept)",
}  # fmt: skip


def _op(
    summary: str,
    tag: str,
    request: str | None = None,
    response: str | None = None,
    *,
    stream: str | None = None,
    errors: tuple[int, ...] = (400, 404, 500),
    status: str = "200",
    response_content: dict | None = None,
    request_content: dict | None = None,
    description: str = "",
    links: dict | None = None,
) -> dict:
    """An operation with a JSON body (if `request`), a JSON response, and `stream` as its streaming media type."""
    openai = tag == "openai"
    content = response_content if response_content is not None else (_json(response) if response else None)
    if stream is not None and response:
        # A stream is a sequence of the response's objects (NDJSON lines, SSE events), the last of which may be
        # an error object when the failure came after streaming began.
        error = _ref("OpenAIError" if openai else "Error")
        content = {**content, stream: {"schema": _array({"anyOf": [_ref(response), error]}) | {
            "description": f"Each {'event' if stream == _SSE else 'line'} one item; an error after streaming began is the last"}}}
    ok = {"description": "Success"} | ({"content": content} if content else {}) | ({"links": links} if links else {})
    op = {"summary": summary, "tags": [tag], "responses": {status: ok} | _error_responses(errors, openai)}
    if description:
        op["description"] = description
    if request or request_content:
        op["requestBody"] = {"required": True, "content": request_content or _json(request)}
    return op


_NDJSON, _SSE = "application/x-ndjson", "text/event-stream"


def _uses_model(pointer: str, **extra: str) -> dict:
    """Links from a response naming a model (at JSON pointer `pointer`) to the operations that take one."""
    model = f"$response.body#{pointer}"
    targets = {"post_api_show": {}, "post_api_chat": {}, "post_api_generate": {}, "post_api_tokenize": {},
               "post_api_embed": {}, "post_api_copy": None, "delete_api_delete": {}}  # fmt: skip
    links = {}
    for operation, body in targets.items():
        request = {"source": model, "destination": "copied"} if body is None else {"model": model} | extra
        links[operation.removeprefix("post_").removeprefix("delete_")] = {"operationId": operation, "requestBody": request}
    return links


_TAGS_LINKS = _uses_model("/models/0/name")
_OPENAI_MODELS_LINKS = {"get_model": {"operationId": "get_v1_models_model", "parameters": {"model": "$response.body#/data/0/id"}}}
_TOKENIZE_LINKS = {"detokenize": {"operationId": "post_api_detokenize",
                                  "requestBody": {"model": "$request.body#/model", "tokens": "$response.body#/tokens"}}}

# Keyed by path shape (arguments reduced to "{}", so the argument's name does not matter) and method.
OPERATIONS: dict[tuple[str, str], dict] = {
    ("/", "get"): _op("Is the server running; the chat page for a browser", "meta", errors=(),
                      response_content={"text/plain": {"schema": {"const": "corral is running"}}, "text/html": {"schema": _STR}},
                      description="Plain text unless the client prefers text/html (a browser), which gets the chat page."),
    ("/ui/{}", "get"): _op("A file of the chat page (its script, renderer, style)", "meta", errors=(404,),
                           response_content={"text/javascript": {"schema": _STR}, "text/css": {"schema": _STR}}),
    ("/", "head"): _op("Is the server running (no body)", "meta", errors=()),
    ("/health", "get"): _op("Liveness, without model work", "meta", response="Health", errors=()),
    ("/metrics", "get"): _op("Prometheus metrics", "meta", errors=(),
                             response_content={"text/plain": {"schema": _STR}},
                             description="Requests by route and status, prompt and generated tokens, queue depth, "
                                         "running sequences, batch size, KV cache cells, models loaded; per model, vLLM's "
                                         "histograms of time to first token, inter-token, end-to-end and queue latency and "
                                         "prompt and generation token counts, prefix-cache queries and hits, runner restarts."),
    ("/openapi.json", "get"): _op("This document", "meta", errors=(),
                                  response_content={"application/json": {"schema": {"type": "object"}}}),
    ("/static/{}", "get"): _op("A static file (Quart's default route; corral ships none)", "meta", errors=(404,),
                               response_content={"application/octet-stream": {"schema": _STR}}),
    ("/api/version", "get"): _op("Server version", "ollama", response="VersionResponse", errors=()),
    ("/api/generate", "post"): _op("Generate a completion", "ollama", "GenerateRequest", "GenerateResponse", stream=_NDJSON),
    ("/api/chat", "post"): _op("Generate the next chat message", "ollama", "ChatRequest", "ChatResponse", stream=_NDJSON),
    ("/api/embed", "post"): _op("Embed inputs", "ollama", "EmbedRequest", "EmbedResponse"),
    ("/api/embeddings", "post"): _op("Embed one prompt (legacy)", "ollama", "EmbeddingsRequest", "EmbeddingsResponse"),
    ("/api/tags", "get"): _op("Models in the store", "ollama", response="TagsResponse", errors=(500,), links=_TAGS_LINKS),
    ("/api/show", "post"): _op("Describe a model", "ollama", "ShowRequest", "ShowResponse"),
    ("/api/ps", "get"): _op("Loaded models", "ollama", response="PsResponse", errors=(500,)),
    ("/api/create", "post"): _op("Create a model", "ollama", "CreateRequest", "Progress", stream=_NDJSON, errors=(400, 404, 500, 507)),
    ("/api/copy", "post"): _op("Copy a model", "ollama", "CopyRequest"),
    ("/api/delete", "delete"): _op("Delete a model", "ollama", "ModelRequest"),
    # 502: the registry failed, or sent a manifest or blob that was refused; 507: the store's disk is full.
    ("/api/pull", "post"): _op("Pull a model", "ollama", "PullRequest", "Progress", stream=_NDJSON, errors=(400, 404, 500, 502, 507)),
    ("/api/push", "post"): _op("Push a model", "ollama", "PullRequest", "Progress", stream=_NDJSON, errors=(400, 404, 500, 502)),
    ("/api/blobs/{}", "head"): _op("Whether the store holds a blob", "ollama", errors=(404,)),
    ("/api/blobs/{}", "post"): _op(
        "Upload a blob", "ollama", status="201", errors=(400, 500, 507),
        request_content={"application/octet-stream": {"schema": {"type": "string", "contentMediaType": "application/octet-stream"}}},
    ),
    ("/api/tokenize", "post"): _op("Token ids of a text", "corral", "TokenizeRequest", "TokenizeResponse", links=_TOKENIZE_LINKS),
    ("/api/detokenize", "post"): _op("Text of token ids", "corral", "DetokenizeRequest", "DetokenizeResponse"),
    ("/v1/chat/completions", "post"): _op("Chat completion", "openai", "ChatCompletionRequest", "ChatCompletion", stream=_SSE),
    ("/v1/completions", "post"): _op("Text completion", "openai", "CompletionRequest", "Completion", stream=_SSE),
    ("/v1/embeddings", "post"): _op("Embeddings", "openai", "OpenAIEmbeddingsRequest", "OpenAIEmbeddings"),
    ("/v1/models", "get"): _op("Models in the store", "openai", response="OpenAIModelList", errors=(500,), links=_OPENAI_MODELS_LINKS),
    ("/v1/models/{}", "get"): _op("One model", "openai", response="OpenAIModel", errors=(404, 500)),
}


def openapi_path(rule: str) -> str:
    """A werkzeug rule as an OpenAPI path: /v1/models/<path:model> -> /v1/models/{model}."""
    return _RULE_ARGUMENT.sub(r"{\1}", rule)


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def route_methods(rule: Any) -> list[str]:
    """The methods a rule serves, less the OPTIONS Quart adds and the HEAD werkzeug adds to every GET."""
    methods = set(rule.methods or ()) - {"OPTIONS"}
    if "GET" in methods:
        methods.discard("HEAD")
    return sorted(method.lower() for method in methods)


def _undocumented(endpoint: str) -> dict:
    return {"summary": endpoint, "tags": [UNDOCUMENTED], "responses": {"default": {"description": "Not described yet"}}}


def document(app: quart.Quart) -> dict:
    """The OpenAPI document of every route `app` serves."""
    paths: dict[str, dict] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        path = openapi_path(rule.rule)
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": _STR}
            for name in _RULE_ARGUMENT.findall(rule.rule)
        ]
        item = paths.setdefault(path, {})
        for method in route_methods(rule):
            op = dict(OPERATIONS.get((_shape(path), method)) or _undocumented(rule.endpoint))
            op["operationId"] = method + (re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_") or "_root")
            if parameters:
                op["parameters"] = parameters
            item[method] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "corral",
            "version": corral.__version__,
            "description": "A local LLM runtime serving the Ollama and OpenAI APIs, plus health, metrics and tokenization.",
        },
        "tags": [
            {"name": "ollama", "description": "Ollama's API"},
            {"name": "openai", "description": "OpenAI-compatible API"},
            {"name": "corral", "description": "corral's additions"},
            {"name": "meta", "description": "Server status and description"},
        ],
        "paths": paths,
        "components": {"schemas": schemas(sampler_options(app))},
    }


def sampler_options(app: quart.Quart) -> dict[str, tuple]:
    """The options the app's installed sampler plugins declare, each `(kind, default[, Check])`."""
    plugins = app.extensions["corral"].scheduler.plugins
    return {name: spec for cls in plugins.samplers().values() for name, spec in getattr(cls, "options", {}).items()}


def schemas(extra_options: dict[str, tuple]) -> dict[str, dict]:
    """SCHEMAS with the options (and the OpenAI fields passed on as options) the samplers declare."""
    options = options_schema(extra_options)
    extras = openai_sampling_extras(options["properties"])
    out = SCHEMAS | {"Options": options}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        out[name] = SCHEMAS[name] | {"properties": extras | SCHEMAS[name]["properties"]}
    return out
