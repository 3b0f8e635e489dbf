"""The embedding endpoints: Ollama's /api/embed and legacy /api/embeddings, OpenAI's /v1/embeddings.

All three go through the scheduler to the runner's `embed` (batched there with concurrent
requests). /api/embed and /v1/embeddings return unit-length vectors, as Ollama does; the legacy
/api/embeddings returns the pooled vector as the model computes it, as Ollama's does.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Sequence

import attrs
import quart
import trio

from corral.modelfile.defaults import model_defaults
from corral.runner.interface import Embeddings
from corral.server.http import ApiError, field, read_json
from corral.server.state import state

bp = quart.Blueprint("embed", __name__)


@attrs.frozen
class Embedded:
    """An embed call's result with its timings (nanoseconds)."""

    result: Embeddings
    load_ns: int
    total_ns: int


async def embed(
    model: str, inputs: Sequence[str | Sequence[int]], *, options: dict | None = None, keep_alive: Any = None,
    truncate: bool = True, dimensions: int | None = None, normalized: bool = True,
) -> Embedded:
    """`inputs` embedded by `model` (loaded as the scheduler decides, with the Modelfile's options under the request's)."""
    server = state()
    started = time.perf_counter_ns()
    defaults = await trio.to_thread.run_sync(model_defaults, server.store, model)
    async with server.scheduler.use(model, defaults.merge_options(options or {}), keep_alive) as loaded:
        load_ns = time.perf_counter_ns() - started  # includes waiting for the model
        result = await loaded.runtime.embed(inputs, truncate=truncate, dimensions=dimensions, normalized=normalized)
    if server.metrics is not None:
        server.metrics.record_generation(result.prompt_eval_count, 0)
    return Embedded(result, load_ns, time.perf_counter_ns() - started)


def _dimensions(body: dict) -> int | None:
    value = field(body, "dimensions", int)
    if value is not None and value < 1:
        raise ApiError(400, f"dimensions must be a positive integer, got {value}")
    return value


# --- Ollama ---------------------------------------------------------------------------------------


def _ollama_inputs(value: Any) -> list[str]:
    """`input` as a list of texts; a lone empty string (or none) embeds nothing, as in Ollama."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ApiError(400, "input must be a string or a list of strings")


@bp.post("/api/embed")
async def api_embed():
    body = await read_json()
    model = field(body, "model", str, required=True)
    inputs = _ollama_inputs(body.get("input"))
    done = await embed(
        model, inputs, options=field(body, "options", dict, {}), keep_alive=body.get("keep_alive"),
        truncate=field(body, "truncate", bool, True), dimensions=_dimensions(body),
    )
    return {
        "model": model,
        "embeddings": done.result.embeddings,
        "total_duration": done.total_ns,
        "load_duration": done.load_ns,
        "prompt_eval_count": done.result.prompt_eval_count,
    }


@bp.post("/api/embeddings")
async def api_embeddings():
    body = await read_json()
    model = field(body, "model", str, required=True)
    prompt = field(body, "prompt", str, "")
    done = await embed(
        model, [prompt] if prompt else [], options=field(body, "options", dict, {}), keep_alive=body.get("keep_alive"), normalized=False
    )
    return {"embedding": done.result.embeddings[0] if done.result.embeddings else []}


# --- OpenAI ---------------------------------------------------------------------------------------


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(token, int) and not isinstance(token, bool) for token in value)


def _openai_inputs(value: Any) -> list[str | list[int]]:
    """`input`: a string, a list of strings, a token array, or a list of token arrays."""
    if isinstance(value, str):
        return [value]
    if _is_tokens(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) or _is_tokens(item) for item in value):
        return value
    raise ApiError(400, "input must be a string, a list of strings, an array of token ids or a list of such arrays, and not empty")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    # base64: the float32 values' little-endian bytes, as OpenAI sends them (its client decodes them with numpy).
    # struct rather than numpy: the routing server does not import numpy (BENCHMARKS.md, "Server RSS").
    return vector if encoding == "float" else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@bp.post("/v1/embeddings")
async def v1_embeddings():
    body = await read_json()
    model = field(body, "model", str, required=True)
    inputs = _openai_inputs(body.get("input"))
    encoding = field(body, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be 'float' or 'base64'")
    done = await embed(model, inputs, dimensions=_dimensions(body))
    tokens = done.result.prompt_eval_count
    return {
        "object": "list",
        "data": [{"object": "embedding", "embedding": _encoded(vector, encoding), "index": i} for i, vector in enumerate(done.result.embeddings)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
