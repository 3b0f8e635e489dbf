"""A small synchronous client for a running corral (or Ollama) server, as the CLI uses it.

    client = Client()                      # CORRAL_HOST / OLLAMA_HOST, default 127.0.0.1:11434
    if client.is_running():
        for chunk in client.chat("smollm2", [{"role": "user", "content": "Hi"}]):
            print(chunk["message"]["content"], end="")

Streaming endpoints are iterators of the server's NDJSON objects; an `{"error": ...}` answer, before
or during a stream, raises `ServerError`. Importing this module does not import torch or the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from corral.address import DEFAULT_HOST, address_from_env, is_loopback_host
from corral.errors import CorralError

CONNECT_TIMEOUT = 5.0
PROBE_TIMEOUT = 1.0
_UPLOAD_CHUNK = 1 << 20


class ServerError(CorralError):
    """The server answered with an error; `status` is None when it came after streaming began."""

    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ServerUnreachableError(CorralError):
    """No server answers at the configured address."""


def base_url_from_env() -> str:
    """The server's URL from CORRAL_HOST (or OLLAMA_HOST); http://127.0.0.1:11434 by default."""
    scheme, host, port = address_from_env()
    # A server bound to every interface is reached over loopback.
    if host in ("0.0.0.0", "::"):
        host = DEFAULT_HOST
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _is_loopback(url: str) -> bool:
    return is_loopback_host(httpx.URL(url).host)


class Client:
    """The Ollama REST API of one server, over httpx."""

    def __init__(self, base_url: str | None = None, timeout: float | None = None, transport: httpx.BaseTransport | None = None):
        self.base_url = (base_url or base_url_from_env()).rstrip("/")
        try:
            loopback = _is_loopback(self.base_url)
        except httpx.InvalidURL:
            raise CorralError(f"{self.base_url} is not a server address; set CORRAL_HOST to host:port") from None
        # Generation and loading may take minutes, so only connecting is bounded by default. Proxy
        # variables are not applied to loopback, as Go's (and so Ollama's) client does.
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT),
            trust_env=not loopback,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def is_running(self) -> bool:
        """Whether a server answers `GET /` within a second."""
        try:
            return self._http.get("/", timeout=PROBE_TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False

    def version(self) -> str:
        """The server's version string."""
        return self._request("GET", "/api/version").json()["version"]

    def generate(self, model: str, prompt: str = "", **fields: Any) -> Iterator[dict]:
        """Stream /api/generate chunks; `fields` are the request's other fields (options, system, ...)."""
        return self._stream("POST", "/api/generate", {"model": model, "prompt": prompt, **_given(fields)})

    def chat(self, model: str, messages: list[dict], **fields: Any) -> Iterator[dict]:
        """Stream /api/chat chunks; `fields` are the request's other fields (options, format, ...)."""
        return self._stream("POST", "/api/chat", {"model": model, "messages": messages, **_given(fields)})

    def load(self, model: str, keep_alive: Any = None) -> dict:
        """Load a model (a generate request with an empty prompt)."""
        return _last(self.generate(model, "", keep_alive=keep_alive))

    def unload(self, model: str) -> dict:
        """Unload a model now (an empty prompt with keep_alive 0)."""
        return _last(self.generate(model, "", keep_alive=0))

    def pull(self, model: str, insecure: bool = False) -> Iterator[dict]:
        """Stream the progress of pulling a model into the server's store (`insecure`: a plain-HTTP registry)."""
        return self._stream("POST", "/api/pull", {"model": model, "insecure": insecure, "stream": True})

    def push(self, model: str, insecure: bool = False) -> Iterator[dict]:
        """Stream the progress of pushing a model from the server's store to its registry."""
        return self._stream("POST", "/api/push", {"model": model, "insecure": insecure, "stream": True})

    def list(self) -> list[dict]:
        """The models in the server's store (/api/tags)."""
        return self._request("GET", "/api/tags").json()["models"]

    def ps(self) -> list[dict]:
        """The models loaded now (/api/ps)."""
        return self._request("GET", "/api/ps").json()["models"]

    def show(self, model: str, verbose: bool = False) -> dict:
        """A model's Modelfile, parameters, template, details and GGUF metadata (/api/show)."""
        return self._request("POST", "/api/show", {"model": model, "verbose": verbose}).json()

    def create(self, model: str, **fields: Any) -> Iterator[dict]:
        """Stream the progress of creating a model from Ollama's JSON fields (`from`, `files`, `system`, ...)."""
        return self._stream("POST", "/api/create", {"model": model, **_given(fields)})

    def has_blob(self, digest: str) -> bool:
        """Whether the server holds a blob."""
        response = self._send("HEAD", f"/api/blobs/{digest}")
        if response.status_code in (200, 404):
            return response.status_code == 200
        raise _error(response)

    def create_blob(self, path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> str:
        """Upload a file as a blob unless the server has it already; returns its digest."""
        path = pathlib.Path(path)
        with open(path, "rb") as file:
            digest = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
        if self.has_blob(digest):
            return digest
        total = path.stat().st_size

        def chunks() -> Iterator[bytes]:
            sent = 0
            with open(path, "rb") as file:
                while chunk := file.read(_UPLOAD_CHUNK):
                    sent += len(chunk)
                    yield chunk
                    if progress:
                        progress(sent, total)

        self._request("POST", f"/api/blobs/{digest}", content=chunks(), headers={"Content-Length": str(total)})
        return digest

    def copy(self, source: str, destination: str) -> None:
        """Give a model a second name."""
        self._request("POST", "/api/copy", {"source": source, "destination": destination})

    def delete(self, model: str) -> None:
        """Remove a model from the server's store."""
        self._request("DELETE", "/api/delete", {"model": model})

    def _send(self, method: str, path: str, body: dict | None = None, **kwargs: Any) -> httpx.Response:
        with self._translate_errors():
            return self._http.request(method, path, json=body, **kwargs)

    def _request(self, method: str, path: str, body: dict | None = None, **kwargs: Any) -> httpx.Response:
        response = self._send(method, path, body, **kwargs)
        if response.is_error:
            raise _error(response)
        return response

    def _stream(self, method: str, path: str, body: dict) -> Iterator[dict]:
        with self._translate_errors(), self._http.stream(method, path, json=body) as response:
            if response.is_error:
                response.read()
                raise _error(response)
            if not response.headers.get("content-type", "").startswith("application/x-ndjson"):
                # A single object, e.g. a load or `"stream": false`.
                items = [json.loads(response.read() or b"{}")]
            else:
                items = (json.loads(line) for line in response.iter_lines() if line.strip())
            for item in items:
                if isinstance(item, dict) and "error" in item:
                    raise ServerError(None, _message(item["error"]))
                yield item

    @contextlib.contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachableError(
                f"could not connect to a corral server at {self.base_url}; start one with `corral serve` "
                "(or point CORRAL_HOST at a running one)"
            ) from exc
        except httpx.TransportError as exc:
            raise ServerError(None, f"lost the connection to {self.base_url}: {exc}") from exc


def _given(fields: dict[str, Any]) -> dict[str, Any]:
    """Request fields without the ones left unset, so the server's defaults apply."""
    return {key.rstrip("_"): value for key, value in fields.items() if value is not None}


def _last(items: Iterator[dict]) -> dict:
    last: dict = {}
    for last in items:
        pass
    return last


def _message(error: Any) -> str:
    # Ollama's endpoints answer {"error": "..."}, OpenAI's {"error": {"message": ...}}.
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _error(response: httpx.Response) -> ServerError:
    try:
        message = _message(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip() or response.reason_phrase
    return ServerError(response.status_code, message)


def _upload_converted(folder: pathlib.Path, upload: Callable[[pathlib.Path], str]) -> str:
    """A safetensors folder converted to GGUF here, as Ollama's CLI reads a folder's files itself, and uploaded."""
    import tempfile

    from corral.convert import convert_folder

    with tempfile.TemporaryDirectory(prefix="corral-convert-") as scratch:
        return upload(convert_folder(folder, pathlib.Path(scratch) / "model.gguf"))


def modelfile_fields(path: str | os.PathLike, upload: Callable[[pathlib.Path], str]) -> dict[str, Any]:
    """A create request's JSON fields from a Modelfile on disk (FROM a .gguf or a converted safetensors folder:
    `upload` returns its digest).

    A GGUF is uploaded as a blob and named in `files`, as Ollama's own CLI does, rather than sent as a
    path in the legacy `modelfile` field: this works with a server on another machine or with another
    view of the file system, and relative paths are taken from the Modelfile's directory here.
    """
    from corral.modelfile.create import ModelSpec
    from corral.modelfile.syntax import Modelfile

    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorralError(f"cannot read the Modelfile {path}: {exc.strerror or exc}") from None
    modelfile = Modelfile.parse(text)
    spec = ModelSpec.from_modelfile(modelfile, path.resolve().parent)
    fields: dict[str, Any] = {"template": modelfile.template, "system": modelfile.system}
    if spec.gguf_path is not None:
        fields["files"] = {spec.gguf_path.name: upload(spec.gguf_path)}
    elif spec.hf_folder is not None:
        fields["files"] = {"model.gguf": _upload_converted(spec.hf_folder, upload)}
    else:
        fields["from"] = spec.from_model
    if spec.projector_path is not None:  # a second FROM: uploaded too; the server tells it by its content
        fields["files"] = {**fields.get("files", {}), spec.projector_path.name: upload(spec.projector_path)}
    if modelfile.parameters:
        fields["parameters"] = modelfile.parameters
    if modelfile.messages:
        fields["messages"] = [message.to_json() for message in modelfile.messages]
    if modelfile.license:
        fields["license"] = list(modelfile.license)
    return {key: value for key, value in fields.items() if value is not None}

