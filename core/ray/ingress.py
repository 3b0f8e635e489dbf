"""The OpenAI-compatible ingress: HTTP in from Ray Serve's proxy, routed by prompt prefix to a `CorralReplica`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from corral.ray.routing import routing_key

log = logging.getLogger(__name__)

# What the ingress serves: the OpenAI API. The Ollama API's writes (pull, create, delete) would change one
# replica's store and not the others', so they are not offered through it.
ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
}
FORWARDED_HEADERS = ("content-type", "authorization", "accept")
ATTEMPTS = 3  # a request whose replica died before answering is sent again (Ray Serve routes it to a live one)


class CorralIngress:
    """Forwards each OpenAI request to a replica chosen by `routing.PrefixAffinityRouter`."""

    def __init__(self, replicas: DeploymentHandle):
        self.replicas = replicas

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if not _served(request.method, path):
            return _error(404 if request.method in ("GET", "POST") else 405, f"{request.method} {path} is not served by corral.ray")
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica's server answers it with corral's 400
        call = (routing_key(path, parsed), request.method, path, body, {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers})
        if isinstance(parsed, dict) and parsed.get("stream") is True:
            return await self._streamed(call)
        for attempt in range(ATTEMPTS):
            try:
                status, headers, content = await self.replicas.forward.remote(*call)
                return Response(content, status_code=status, headers=headers)
            except RayActorError:
                log.warning("replica died before answering %s (attempt %d of %d)", path, attempt + 1, ATTEMPTS)
        return _error(503, "no replica could answer: try again")

    async def _streamed(self, call: tuple) -> Response:
        for attempt in range(ATTEMPTS):
            chunks = self.replicas.options(stream=True).stream.remote(*call)
            try:
                status, headers = await chunks.__anext__()
            except RayActorError:
                log.warning("replica died before streaming %s (attempt %d of %d)", call[2], attempt + 1, ATTEMPTS)
                continue
            return StreamingResponse(_rest(chunks), status_code=status, headers=headers)
        return _error(503, "no replica could answer: try again")


async def _rest(chunks) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except RayActorError:
        # The replica died mid-stream: end it the way corral ends a stream that fails after it began.
        event = {"error": {"message": "the replica serving this stream stopped", "type": "server_error", "param": None, "code": None}}
        yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()


def _served(method: str, path: str) -> bool:
    return (method, path) in ROUTES or (method == "GET" and path.startswith("/v1/models/"))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}, status_code=status)
