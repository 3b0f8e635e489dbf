"""The Quart-Trio application: Ollama and OpenAI APIs over one scheduler."""

from __future__ import annotations

import quart
import trio
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from corral.address import DEFAULT_HOST
from corral.scheduler import Scheduler
from corral.server import create, embed, extras, metrics, models, ollama, openai, page
from corral.server.guard import Guard, Refusal, is_preflight
from corral.server.http import ApiError, as_api_error
from corral.server.state import ServerState
from corral.store import Store


def create_app(scheduler: Scheduler, store: Store, nursery: trio.Nursery, guard: Guard | None = None) -> QuartTrio:
    """An app serving `scheduler`'s models; `nursery` (the server's) runs background work such as pulls.

    `guard` decides which origins, Host names and keys are let in (default: a loopback server's, from the environment)."""
    guard = guard or Guard.from_env(DEFAULT_HOST)
    app = QuartTrio("corral", static_folder=None)
    app.config.update(MAX_CONTENT_LENGTH=None, BODY_TIMEOUT=None, RESPONSE_TIMEOUT=None)
    app.extensions["corral"] = ServerState(scheduler, store, metrics.install(app, scheduler), nursery)
    for blueprint in (ollama.bp, models.bp, create.bp, openai.bp, embed.bp, extras.bp, page.bp):
        app.register_blueprint(blueprint)

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError):
        api = as_api_error(error)  # its message, too, is scrubbed of server paths
        return _error_body(api), api.status

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        return _error_body(ApiError(error.code or 500, error.description or error.name)), error.code

    @app.errorhandler(Exception)
    async def any_error(error: Exception):
        api = as_api_error(error)
        return _error_body(api), api.status

    @app.before_request
    async def guard_request():
        request = quart.request
        try:
            guard.check(request.method, request.path, request.headers)
        except Refusal as refusal:
            raise ApiError(refusal.status, refusal.message, "authentication_error" if refusal.status == 401 else "permission_error") from None
        if is_preflight(request.method, request.headers):
            return "", 204  # the CORS headers are added below

    @app.after_request
    async def cors(response: quart.Response) -> quart.Response:
        response.headers.update(guard.cors_headers(quart.request.headers.get("Origin")))
        if response.status_code == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.after_request
    async def close_after_unread_body(response: quart.Response) -> quart.Response:
        # A body no handler reads (an error answered before reading it: a 405, a bad digest in a blob URL; a GET
        # sent with one) is left on the connection, and the next request sent on it would wait forever
        # (hypercorn 0.18): close the connection instead.
        unread = response.status_code >= 400 or quart.request.method in ("GET", "HEAD", "OPTIONS")
        if unread and _has_body(quart.request):
            response.headers["Connection"] = "close"
        return response

    return app


def _has_body(request: quart.Request) -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def _error_body(error: ApiError) -> dict:
    # OpenAI clients read {"error": {"message": ...}}; Ollama clients read {"error": "..."}.
    if quart.request.path.startswith("/v1/"):
        return {"error": {"message": error.message, "type": error.kind, "param": None, "code": None}}
    return {"error": error.message}
