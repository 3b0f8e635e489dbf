"""The OCI distribution protocol as Ollama's registries speak it, over httpx.

    with Registry("registry.ollama.ai") as registry:
        raw = registry.manifest("library/qwen3", "latest")
        with registry.blob("library/qwen3", digest, 0, size) as response: ...

A request the registry answers 401 with a `WWW-Authenticate: Bearer realm=...,service=...,scope=...`
challenge is sent again, once, with a token fetched from that realm. The token lives only in memory
and in the Authorization header; it is never logged. Redirects are followed (blobs are usually served
from a CDN); httpx drops the Authorization header when a redirect leaves the registry's origin, and a
redirect from https to plain http is refused unless the registry is `insecure`.

Everything the registry sends is bounded: manifests, token answers and error bodies are read up to a
cap and no further.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator

import httpx

from corral.address import is_loopback_host
from corral.distribution.errors import RegistryAuthError, RegistryError, RegistryUnreachableError, UntrustedContentError

log = logging.getLogger(__name__)

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_ACCEPT = f"{DOCKER_MANIFEST}, {OCI_MANIFEST}"

# distribution's own limit for a manifest body; a model's manifest is a few hundred bytes.
MAX_MANIFEST_BYTES = 4 << 20
MAX_TOKEN_BYTES = 64 << 10
MAX_ERROR_BYTES = 64 << 10
_MAX_MESSAGE_CHARS = 300

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')
# A token goes into a header: visible ASCII only, so a hostile token service cannot inject lines.
_TOKEN = re.compile(r"[\x21-\x7e]{1,8192}")

Content = bytes | Callable[[], Iterable[bytes]] | None


class RegistryStatusError(RegistryError):
    """The registry answered a request with an unexpected HTTP status; `status` is it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Registry:
    """One registry host, spoken to over https (plain http when `insecure`)."""

    def __init__(self, host: str, insecure: bool = False, transport: httpx.BaseTransport | None = None):
        self.host = host
        self.insecure = insecure
        scheme = "http" if insecure else "https"
        # Only connecting and each read are bounded: a large blob may take hours, but never stalls unnoticed.
        self._http = httpx.Client(
            base_url=f"{scheme}://{host}",
            timeout=httpx.Timeout(60.0, connect=10.0),
            follow_redirects=True,
            trust_env=not _is_loopback(host),  # proxies never apply to loopback, as with Go's client
            transport=transport,
        )
        self._token: str | None = None
        self._auth_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the protocol ---------------------------------------------------------------------------

    def manifest(self, repository: str, reference: str) -> bytes:
        """The raw manifest of `repository:reference` (docker v2 schema 2 or OCI), at most MAX_MANIFEST_BYTES."""
        headers = {"Accept": MANIFEST_ACCEPT}
        with self.send("GET", f"/v2/{repository}/manifests/{reference}", headers=headers) as response:
            return read_capped(response, MAX_MANIFEST_BYTES, "the manifest")

    @contextlib.contextmanager
    def blob(self, repository: str, digest: str, start: int, end: int) -> Iterator[httpx.Response]:
        """The streamed response for bytes [start, end) of a blob (206, or 200 when the server ignores Range)."""
        # Identity encoding: ranges and sizes are of the blob's own bytes, never of a compressed form.
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with self.send("GET", f"/v2/{repository}/blobs/{digest}", headers=headers, expect=(200, 206)) as response:
            yield response

    def has_blob(self, repository: str, digest: str) -> bool:
        """Whether the registry holds a blob (HEAD)."""
        with self.send("HEAD", f"/v2/{repository}/blobs/{digest}", expect=(200, 404)) as response:
            return response.status_code == 200

    def start_upload(self, repository: str) -> httpx.URL:
        """Open an upload session; returns the URL to send its data to."""
        with self.send("POST", f"/v2/{repository}/blobs/uploads/", expect=(202,)) as response:
            return _location(response)

    def upload_chunk(self, url: httpx.URL, chunk: bytes, start: int) -> httpx.URL:
        """Append `chunk` (which starts at byte `start` of the blob) to an upload; returns the next URL."""
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{start}-{start + len(chunk) - 1}",  # distribution's form: no unit, inclusive end
            "Content-Length": str(len(chunk)),
        }
        with self.send("PATCH", url, headers=headers, content=chunk, expect=(202,)) as response:
            # The registry says how much it holds ("0-<last byte>"); anything short of this chunk's end is lost data.
            held = response.headers.get("Range", "")
            if held and held.rpartition("-")[2] != str(start + len(chunk) - 1):
                end = start + len(chunk) - 1
                raise RegistryError(f"the registry {self.host} holds bytes {held} of an upload after a chunk ending at {end}")
            return _location(response)

    def finish_upload(self, url: httpx.URL, digest: str, content: Content = None, size: int = 0) -> None:
        """Close an upload as `digest`, sending its (remaining) bytes: all of them in a monolithic upload."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        target = url.copy_merge_params({"digest": digest})
        with self.send("PUT", target, headers=headers, content=content, expect=(201,)):
            pass

    def put_manifest(self, repository: str, reference: str, raw: bytes, media_type: str = DOCKER_MANIFEST) -> None:
        """Publish a manifest under a tag; every blob it names must be in the registry already."""
        headers = {"Content-Type": media_type}
        with self.send("PUT", f"/v2/{repository}/manifests/{reference}", headers=headers, content=raw, expect=(201,)):
            pass

    # ---- requests, auth, errors -----------------------------------------------------------------

    @contextlib.contextmanager
    def send(
        self, method: str, url: str | httpx.URL, headers: dict | None = None, content: Content = None, expect: tuple[int, ...] = (200,)
    ) -> Iterator[httpx.Response]:
        """A streamed response with a status in `expect`; a Bearer challenge is answered once, other statuses raise."""
        response = self._send_once(method, url, headers, content)
        if response.status_code == 401:
            challenge = response.headers.get("WWW-Authenticate", "")
            response.close()
            self._authenticate(challenge)
            response = self._send_once(method, url, headers, content)
        try:
            if response.status_code not in expect:
                raise self._status_error(response, method)
            if response.url.scheme != "https" and not self.insecure:
                raise UntrustedContentError(f"the registry {self.host} redirected to plain HTTP ({response.url.host}); refused")
            yield response
        finally:
            response.close()

    def _send_once(self, method: str, url: str | httpx.URL, headers: dict | None, content: Content) -> httpx.Response:
        headers = dict(headers or {})
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        body = content() if callable(content) else content
        request = self._http.build_request(method, url, headers=headers, content=body)
        try:
            return self._http.send(request, stream=True)
        except httpx.RequestError as error:
            raise RegistryUnreachableError(f"cannot reach the registry {self.host}: {_describe(error)}{self._hint(error)}") from None

    def _hint(self, error: httpx.RequestError) -> str:
        if not self.insecure and "SSL" in str(error):
            return " (for a registry that speaks plain HTTP, pass --insecure)"
        return ""

    def _authenticate(self, challenge: str) -> None:
        """Fetch a token for a `Bearer realm=...,service=...,scope=...` challenge."""
        scheme, _, rest = challenge.partition(" ")
        if scheme.lower() != "bearer":
            kind = scheme or "no"
            raise RegistryAuthError(f"the registry {self.host} asks for {kind} authentication; corral speaks Bearer token auth only")
        values = dict(_CHALLENGE_PARAM.findall(rest))
        try:
            realm = httpx.URL(values.get("realm", ""))
        except httpx.InvalidURL:
            realm = httpx.URL("")
        allowed = ("https", "http") if self.insecure else ("https",)
        if realm.scheme not in allowed or not realm.host:
            raise RegistryAuthError(f"the registry {self.host} names an unusable token service {values.get('realm', '')!r}")
        params = {key: values[key] for key in ("service", "scope") if key in values}
        with self._auth_lock:
            try:
                with self._http.stream("GET", realm, params=params) as response:
                    body = read_capped(response, MAX_TOKEN_BYTES, "the token answer")
                    status = response.status_code
            except httpx.RequestError as error:
                raise RegistryAuthError(f"cannot reach the token service of {self.host}: {_describe(error)}") from None
            if status != 200:
                scope = params.get("scope", "access")
                raise RegistryAuthError(f"the token service of {self.host} refused a token for {scope} (HTTP {status})")
            token = _token_from(body)
            if token is None:
                raise RegistryAuthError(f"the token service of {self.host} sent no usable token")
            self._token = token
        log.debug("got a token from the token service of %s for %s", self.host, params.get("scope", "access"))

    def _status_error(self, response: httpx.Response, method: str) -> RegistryStatusError:
        status = response.status_code
        detail = ""
        if method != "HEAD":
            with contextlib.suppress(httpx.RequestError, UntrustedContentError):
                detail = _error_detail(read_capped(response, MAX_ERROR_BYTES, "the error"))
        path = response.request.url.path
        message = f"the registry {self.host} answered {status} to {method} {path}" + (f": {detail}" if detail else "")
        if status in (401, 403):
            return RegistryStatusError(status, message + " (access denied)")
        return RegistryStatusError(status, message)


def read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    """A response body of at most `limit` bytes; a longer one is cut off and refused."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise UntrustedContentError(f"{what} from the registry is {declared} bytes, more than the {limit} allowed")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise UntrustedContentError(f"{what} from the registry is larger than the {limit} bytes allowed")
    return bytes(body)


def _token_from(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    token = data.get("token") or data.get("access_token")
    return token if isinstance(token, str) and _TOKEN.fullmatch(token) else None


def _error_detail(body: bytes) -> str:
    """The messages of an OCI error body ({"errors": [{"code", "message"}]}), or its text, shortened."""
    try:
        errors = json.loads(body)["errors"]
        text = "; ".join(f"{error.get('code', '')} {error.get('message', '')}".strip() for error in errors)
    except (ValueError, KeyError, TypeError, AttributeError):
        text = body.decode("utf-8", "replace").strip()
    text = " ".join(text.split())
    return text[:_MAX_MESSAGE_CHARS] + ("..." if len(text) > _MAX_MESSAGE_CHARS else "")


def _location(response: httpx.Response) -> httpx.URL:
    location = response.headers.get("Location")
    if not location:
        raise RegistryError(f"the registry answered {response.request.method} {response.request.url.path} without a Location")
    return response.url.join(location)


def _describe(error: httpx.RequestError) -> str:
    return str(error) or type(error).__name__


def _is_loopback(host: str) -> bool:
    """`host` as a registry names it: a name or address, with a port or not."""
    return is_loopback_host(host.rsplit(":", 1)[0] if host.count(":") == 1 else host)
