"""HTTP plumbing shared by the API modules: request bodies, errors with status codes, streaming framings."""

from __future__ import annotations

import datetime
import json
import logging
import re
from typing import Any, AsyncIterator, Callable

import quart

from corral.distribution.errors import NotEnoughSpaceError, RegistryError
from corral.errors import (
    CorralError,
    GGUFError,
    InsufficientMemoryError,
    InvalidModelNameError,
    MissingTensorError,
    ModelNotFoundError,
    UnknownArchitectureError,
    UnsupportedTensorTypeError,
)
from corral.options import InvalidOptionError
from corral.runner.process import RunnerError
from corral.scheduler import InvalidKeepAliveError, ServerBusyError
from corral.store import StoreFullError
from corral.template import TemplateError

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


class ApiError(Exception):
    """An error answered with `status` and a message the client can act on."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


_STATUS_BY_ERROR: list[tuple[type[BaseException], int]] = [
    (ModelNotFoundError, 404),
    (ServerBusyError, 503),
    (InsufficientMemoryError, 503),  # not the request's fault: other models, or a smaller one, would fit
    (RunnerError, 500),
    (InvalidModelNameError, 400),
    (InvalidOptionError, 400),
    (InvalidKeepAliveError, 400),
    (TemplateError, 400),
    (UnknownArchitectureError, 500),
    (UnsupportedTensorTypeError, 500),
    (MissingTensorError, 500),
    (GGUFError, 500),
    (StoreFullError, 507),  # Insufficient Storage: the server's disk, not the request
    (NotEnoughSpaceError, 507),  # the same, found before a pull wrote anything
    (RegistryError, 502),  # the registry failed or sent something unusable: not the client's fault, nor ours
]


# Errors that mean a model in the store cannot be loaded: the message says what to do about it.
_UNLOADABLE = (UnknownArchitectureError, UnsupportedTensorTypeError, MissingTensorError, GGUFError)
_UNLOADABLE_ADVICE = "; re-create the model from a GGUF that `corral create` accepts, or pull it again"

# An absolute file-system path of two or more parts (not one of the API's own routes): the store's
# blobs, the server's files. Error bodies name what the client knows instead (a blob digest, a file name).
_SERVER_PATH = re.compile(r"(?<![\w.~:/-])/(?!api/|v1/)[\w.@+~-]+(?:/[\w.@+~-]+)+/?")
_BLOB_NAME = re.compile(r"sha256-([0-9a-f]{64})")


def public_message(text: str) -> str:
    """`text` with every server path replaced by its last part (a blob by its digest), for an error body."""

    def last_part(match: re.Match) -> str:
        name = match.group(0).rstrip("/").rsplit("/", 1)[-1]
        return _BLOB_NAME.sub(r"sha256:\1", name)

    return _SERVER_PATH.sub(last_part, text)


def as_api_error(exc: BaseException) -> ApiError:
    """The status and message a raised error becomes; the message names no server path."""
    if isinstance(exc, ApiError):
        return ApiError(exc.status, public_message(exc.message), exc.kind)
    for kind, status in _STATUS_BY_ERROR:
        if isinstance(exc, kind):
            message = public_message(str(exc)) + (_UNLOADABLE_ADVICE if isinstance(exc, _UNLOADABLE) else "")
            return ApiError(status, message, "invalid_request_error" if status < 500 else "server_error")
    if isinstance(exc, CorralError):
        return ApiError(400, public_message(str(exc)))
    # Anything else is a bug: the traceback goes to the log; the response gets the first line of the message only,
    # without server paths (a message that spans lines is usually a traceback or a dump).
    log.exception("unexpected error while serving a request", exc_info=exc)
    first = public_message(str(exc).strip().splitlines()[0][:300]) if str(exc).strip() else type(exc).__name__
    return ApiError(500, f"internal error: {first}", "server_error")


async def read_json() -> dict[str, Any]:
    """The request body as a JSON object; 400 when missing or malformed."""
    raw = await quart.request.get_data()
    if not raw.strip():
        raise ApiError(400, "missing request body")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, required: bool = False) -> Any:
    """A typed field of a request body (400 when missing but required, or of the wrong type)."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name} is required")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"{name} must be of type {names}, not {type(value).__name__}")
    return value


def now_rfc3339() -> str:
    """The current time as an RFC 3339 UTC timestamp."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def ndjson_response(chunks: AsyncIterator[dict], on_error: Callable[[ApiError], dict]) -> quart.Response:
    """One JSON object per line; an error after streaming began becomes a final error line."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for item in chunks:
                yield (json.dumps(item) + "\n").encode()
        except Exception as exc:  # noqa: BLE001 - reported to the client in-band
            yield (json.dumps(on_error(as_api_error(exc))) + "\n").encode()

    return _streaming(body(), NDJSON)


def sse_response(chunks: AsyncIterator[dict], on_error: Callable[[ApiError], dict]) -> quart.Response:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for item in chunks:
                yield f"data: {json.dumps(item)}\n\n".encode()
        except Exception as exc:  # noqa: BLE001 - reported to the client in-band
            yield f"data: {json.dumps(on_error(as_api_error(exc)))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return _streaming(body(), SSE)


def _streaming(body: AsyncIterator[bytes], mimetype: str) -> quart.Response:
    response = quart.Response(body, mimetype=mimetype)
    response.timeout = None  # generation may take longer than Quart's default response timeout
    return response
