"""Endpoints beyond both APIs: /health, /metrics, /api/tokenize, /api/detokenize, /openapi.json."""

from __future__ import annotations

import quart

from corral.server import openapi
from corral.server.http import ApiError, field, read_json
from corral.server.metrics import CONTENT_TYPE
from corral.server.state import state

bp = quart.Blueprint("extras", __name__)


@bp.get("/health")
async def health():
    return {"status": "ok", "models_loaded": len(state().scheduler.loaded)}


@bp.get("/metrics")
async def metrics():
    return state().metrics.exposition(), 200, {"Content-Type": CONTENT_TYPE}


@bp.get("/openapi.json")
async def openapi_document():
    return openapi.document(quart.current_app)


@bp.post("/api/tokenize")
async def tokenize():
    body = await read_json()
    name = field(body, "model", str, required=True)
    # llama.cpp's server calls the text "content"; other clients send "text" or "prompt".
    key = next((key for key in ("content", "text", "prompt") if body.get(key) is not None), "content")
    text = field(body, key, str, required=True)
    add_special = field(body, "add_special", bool, True)
    async with state().scheduler.use(name, {}, body.get("keep_alive")) as loaded:
        tokens = await loaded.runtime.tokenize(text, add_special=add_special)
    return {"tokens": tokens}


@bp.post("/api/detokenize")
async def detokenize():
    body = await read_json()
    name = field(body, "model", str, required=True)
    tokens = field(body, "tokens", list, required=True)
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in tokens):
        raise ApiError(400, "tokens must be a list of integer token ids")
    async with state().scheduler.use(name, {}, body.get("keep_alive")) as loaded:
        vocab_size = loaded.runtime.vocab_size
        outside = [token for token in tokens if not 0 <= token < vocab_size]
        if outside:
            raise ApiError(400, f"token id {outside[0]} is outside the vocabulary of {vocab_size} tokens")
        content = await loaded.runtime.detokenize(tokens)
    return {"content": content}
