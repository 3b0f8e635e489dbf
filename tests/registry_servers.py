"""Real servers for the registry tests: Debian's docker-registry, a byte-counting proxy that can cut
connections, and a small registry of our own that serves whatever manifest a test hands it (the
real registry will not serve a hostile one) and can demand Bearer token auth.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import attrs
import httpx

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- docker-registry ------------------------------------------------------------------------------


@attrs.frozen
class DockerRegistry:
    """A running docker-registry: `host` is 127.0.0.1:<port>, blobs live under `storage`."""

    host: str
    storage: pathlib.Path

    def blob_file(self, digest: str) -> pathlib.Path:
        """Where the registry's filesystem driver keeps a blob's bytes."""
        hex_digest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"


@contextlib.contextmanager
def docker_registry(root: pathlib.Path) -> Iterator[DockerRegistry]:
    """`docker-registry serve` with filesystem storage under `root`, on a free loopback port."""
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is not installed"
    port = free_port()
    storage = root / "storage"
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    with open(root / "registry.log", "wb") as log:
        process = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield DockerRegistry(f"127.0.0.1:{port}", storage)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- a proxy that counts and cuts -----------------------------------------------------------------


class CuttingProxy:
    """Forwards GET/HEAD to an upstream registry, counting blob body bytes; with a `budget`, it cuts
    every blob answer (closes the connection mid-body) once that many blob bytes have gone through."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.budget: int | None = None
        self.once = False
        self.blob_bytes = 0
        self.ranges: list[tuple[str, str]] = []  # (digest, Range header) of each blob GET
        self._lock = threading.Lock()
        self._server = _serve_in_thread(self._handler())
        self.host = f"127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self, budget: int | None = None, once: bool = False) -> None:
        """Count afresh; cut blob answers after `budget` bytes (all of them, or only the first cut when `once`)."""
        with self._lock:
            self.budget, self.once, self.blob_bytes, self.ranges = budget, once, 0, []

    def _allowance(self, wanted: int) -> int:
        with self._lock:
            allowed = wanted if self.budget is None else max(0, min(wanted, self.budget - self.blob_bytes))
            self.blob_bytes += allowed
            if allowed < wanted and self.once:
                self.budget = None
            return allowed

    def _handler(self):
        proxy = self

        class Handler(_QuietHandler):
            def do_HEAD(self):
                self.forward(body=False)

            def do_GET(self):
                self.forward(body=True)

            def forward(self, body: bool) -> None:
                headers = {key: value for key, value in self.headers.items() if key.lower() in ("range", "accept", "authorization")}
                is_blob = "/blobs/" in self.path
                if is_blob and body:
                    with proxy._lock:
                        proxy.ranges.append((self.path.rpartition("/")[2], self.headers.get("Range", "")))
                with httpx.stream(self.command, f"http://{proxy.upstream}{self.path}", headers=headers) as upstream:
                    self.send_response(upstream.status_code)
                    for key, value in upstream.headers.items():
                        if key.lower() in ("content-type", "content-length", "content-range", "docker-content-digest", "location"):
                            self.send_header(key, value)
                    self.end_headers()
                    if not body:
                        return
                    for chunk in upstream.iter_raw(16 << 10):
                        allowed = proxy._allowance(len(chunk)) if is_blob else len(chunk)
                        self.wfile.write(chunk[:allowed])
                        if allowed < len(chunk):
                            self.wfile.flush()
                            self.close_connection = True
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return

        return Handler


# ---- a registry of our own ----------------------------------------------------------------------


class FakeRegistry:
    """Serves `manifests[(repository, tag)]` and `blobs[digest]` (any digest string, so a test sees
    what was asked for); honours Range unless `ignore_range`; with `token`, demands Bearer auth."""

    def __init__(self):
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.blobs: dict[str, bytes] = {}
        self.ignore_range = False
        self.token: str | None = None
        self.token_status = 200
        self.stall_at: int | None = None  # blob answers stop at this byte until `release` is set, then the connection drops
        self.release = threading.Event()
        self.requests: list[str] = []
        self.ranges: list[str] = []
        self.authorizations: list[str | None] = []  # the Authorization header of each blob GET
        self.redirect_blobs_to: str | None = None  # a base URL (another FakeRegistry, a "CDN") blob GETs are sent to
        self.token_requests: list[dict] = []
        self._server = _serve_in_thread(self._handler())
        self.host = f"127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_model(self, repository: str, tag: str, layers: list[dict], config: dict | None = None) -> bytes:
        """Publish a manifest (layer dicts as they go into it) and return its bytes."""
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "layers": layers}
        if config is not None:
            manifest["config"] = config
        raw = json.dumps(manifest).encode()
        self.manifests[(repository, tag)] = raw
        return raw

    def _handler(self):
        registry = self

        class Handler(_QuietHandler):
            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == "/token":
                    self.answer_token(query)
                    return
                registry.requests.append(path)
                if registry.token and self.headers.get("Authorization") != f"Bearer {registry.token}":
                    realm = f"http://{registry.host}/token"
                    scope = "repository:" + path.removeprefix("/v2/").split("/manifests/")[0].split("/blobs/")[0] + ":pull"
                    challenge = f'Bearer realm="{realm}",service="fake-registry",scope="{scope}"'
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}'
                    self.reply(401, body, {"WWW-Authenticate": challenge})
                    return
                if "/manifests/" in path:
                    repository, _, tag = path.removeprefix("/v2/").partition("/manifests/")
                    raw = registry.manifests.get((repository, tag))
                    if raw is None:
                        self.reply(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}')
                    else:
                        self.reply(200, raw, {"Content-Type": MANIFEST_TYPE})
                    return
                registry.authorizations.append(self.headers.get("Authorization"))
                if registry.redirect_blobs_to:
                    self.reply(307, b"", {"Location": registry.redirect_blobs_to + self.path})
                    return
                digest = path.partition("/blobs/")[2]
                data = registry.blobs.get(digest)
                if data is None:
                    self.reply(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
                    return
                requested = self.headers.get("Range", "")
                registry.ranges.append(requested)
                if requested.startswith("bytes=") and not registry.ignore_range:
                    first, _, last = requested.removeprefix("bytes=").partition("-")
                    start, end = int(first), min(int(last) + 1, len(data))
                    self.reply(206, data[start:end], {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}, start)
                else:
                    self.reply(200, data, offset=0)

            def reply(self, status: int, body: bytes, headers: dict | None = None, offset: int | None = None) -> None:
                """Send an answer; a blob's (`offset`: where its body starts in the blob) may stall."""
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if registry.stall_at is None or offset is None:
                    self.wfile.write(body)
                    return
                self.wfile.write(body[: max(0, registry.stall_at - offset)])
                self.wfile.flush()
                registry.release.wait(30)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def answer_token(self, query: str) -> None:
                params = dict(httpx.QueryParams(query))
                registry.token_requests.append(params)
                if registry.token_status != 200:
                    self.reply(registry.token_status, b'{"errors":[{"code":"DENIED"}]}')
                else:
                    self.reply(200, json.dumps({"token": registry.token}).encode())

        return Handler


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class _Server(http.server.ThreadingHTTPServer):
    """A client hanging up mid-reply is what several tests do on purpose (they refuse what they read)."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _serve_in_thread(handler) -> http.server.ThreadingHTTPServer:
    server = _Server(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    # a short poll: shutdown() waits for the loop to look (0.5 s by default), and every test closes its server
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server
