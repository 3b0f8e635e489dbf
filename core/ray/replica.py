"""The Ray Serve replica: one corral server (see server.py) answering the requests the ingress routes to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from ray import serve

from corral.errors import CorralError
from corral.ray.server import ThreadedServer

LOAD_TIMEOUT = 600.0  # seconds the replica's model has to load before the replica reports itself started
REPLICA_HEADER = "x-corral-replica"  # names the replica that answered (for clients and tests of the routing)


class ModelLoadError(CorralError):
    """The replica could not load its model."""


class CorralReplica:
    """Owns a corral server over one store and keeps `model` loaded in it; every call takes the routing key first
    (read by `routing.PrefixAffinityRouter`), then the HTTP request to hand to the server."""

    def __init__(self, model: str, store: str | None = None, runner: str | None = None):
        self.server = ThreadedServer(store, runner)
        url = self.server.start()
        self.name = serve.get_replica_context().replica_id.unique_id
        # An empty prompt with keep_alive -1 loads the model and keeps it: the first request routed here does not wait
        # for a load, and a model that is not in the store fails the replica's start with corral's own message.
        loaded = httpx.post(f"{url}/api/generate", json={"model": model, "keep_alive": -1}, timeout=LOAD_TIMEOUT)
        if loaded.status_code != 200:
            self.server.stop()
            raise ModelLoadError(f"replica could not load {model!r}: {_error_message(loaded)}")
        # No idle keep-alive connections: the server's graceful stop waits for open connections to close, so one left
        # idle here would hold every replica's stop for seconds. A new loopback connection per request costs well under 1 ms.
        self.client = httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_keepalive_connections=0))

    async def forward(self, key: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
        """One request answered whole: (status, headers, body)."""
        response = await self.client.request(method, path, content=body, headers=headers)
        return response.status_code, self._headers(response), response.content

    async def stream(self, key: str, method: str, path: str, body: bytes, headers: dict) -> AsyncIterator:
        """One streamed request: first (status, headers), then the body's bytes as the server sends them."""
        async with self.client.stream(method, path, content=body, headers=headers) as response:
            yield response.status_code, self._headers(response)
            async for chunk in response.aiter_raw():
                yield chunk

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose server stopped or does not answer is replaced."""
        if not self.server.alive():
            raise CorralError("the replica's corral server has stopped")
        (await self.client.get("/health", timeout=10.0)).raise_for_status()

    def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica: the server finishes what runs and reaps its runners.
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()

    def _headers(self, response: httpx.Response) -> dict:
        headers = {REPLICA_HEADER: self.name}
        if "content-type" in response.headers:
            headers["content-type"] = response.headers["content-type"]
        return headers


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        return f"HTTP {response.status_code}"
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)
