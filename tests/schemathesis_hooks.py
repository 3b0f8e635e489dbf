"""Schemathesis hooks for tests/test_schema_fuzz.py (loaded with SCHEMATHESIS_HOOKS): deserializers for the
streaming routes, so each NDJSON line and SSE event is checked against the schema, and a bound on generation
length so a generated request cannot run a tiny model for minutes (`num_predict` -1 with context shift never ends)."""

import json

import schemathesis

MAX_TOKENS = 8


@schemathesis.deserializer("application/x-ndjson")
def ndjson(ctx, response):
    """The lines of an NDJSON stream, each one JSON value."""
    return [json.loads(line) for line in response.content.splitlines() if line.strip()]


@schemathesis.deserializer("text/event-stream")
def server_sent_events(ctx, response):
    """The JSON data of each server-sent event, less the closing [DONE]."""
    events = []
    for line in response.content.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    """At most MAX_TOKENS generated tokens per request (the body otherwise as generated)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body and isinstance(body[name], int) and not isinstance(body[name], bool) and body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if case.path in ("/v1/chat/completions", "/v1/completions") and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if case.path in ("/api/generate", "/api/chat"):
        options = body.setdefault("options", {})
        if not isinstance(options, dict):
            return  # refused with a 400 before any generation
        predict = options.get("num_predict")
        if not isinstance(predict, int) or isinstance(predict, bool) or predict < 0 or predict > MAX_TOKENS:
            options["num_predict"] = MAX_TOKENS
