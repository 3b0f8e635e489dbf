"""A local HTTP server answering the Hugging Face Hub endpoints huggingface_hub calls, over a folder of repos.

`root/<user>/<repo>/<files>` are the repositories. The server answers, as the Hub does:

* `GET /api/models/<user>/<repo>[/revision/<rev>]`: the model info, `siblings` with sizes and, every
  file being LFS here, `lfs: {sha256, size, pointerSize}`; `sha` is the commit;
* `HEAD|GET /<user>/<repo>/resolve/<rev>/<path>`: the file, with `X-Repo-Commit`, `ETag` and
  `X-Linked-Etag` (the sha256, as for LFS files), `X-Linked-Size`, `Content-Length`, `Accept-Ranges` and
  `Range` requests answered 206;
* errors as the Hub sends them: 404 with `X-Error-Code: RepoNotFound` or `EntryNotFound`, and a
  private repo answers 401 `RepoNotFound` unless the request carries its bearer token.

Every request is recorded in `requests` as (method, path) so a test can count downloads. It binds to
127.0.0.1 on a free port and runs in a thread (`with HubServer(root) as hub: ... hub.url`).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class HubServer:
    """The Hub's model endpoints over `root`; `private` maps a repo id to the token that may read it, `tamper`
    a repo id to a function that rewrites its model info (a hostile or broken Hub); `gated` repos answer 403
    GatedRepo; a file in `interrupt_once` sends half its bytes on its first GET and drops the connection."""

    def __init__(
        self,
        root: Path,
        private: dict[str, str] | None = None,
        tamper: dict[str, Callable[[dict], None]] | None = None,
        gated: frozenset[str] = frozenset(),
        interrupt_once: frozenset[str] = frozenset(),
    ) -> None:
        self.root = Path(root)
        self.private = private or {}
        self.tamper = tamper or {}
        self.gated = gated
        self.interrupt = set(interrupt_once)  # `<repo>/<path>` whose next whole GET breaks off halfway
        self.ranges: list[str] = []
        self._digests: dict[tuple[Path, int, int], tuple[str, str]] = {}
        self.requests: list[tuple[str, str]] = []
        self.authorizations: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def downloads(self, name: str | None = None) -> int:
        """How many GETs of file contents the server answered (of files named `name`, if given)."""
        gets = [path for method, path in self.requests if method == "GET" and "/resolve/" in path]
        return sum(1 for path in gets if name is None or path.endswith("/" + name))

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # ---- the repositories ----

    def repo_dir(self, repo_id: str) -> Path | None:
        folder = self.root / repo_id
        return folder if ".." not in repo_id.split("/") and folder.is_dir() else None

    def digests(self, path: Path) -> tuple[str, str]:
        """(git blob sha1, sha256) of a file, remembered while its size and mtime stay the same."""
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key not in self._digests:
            data = path.read_bytes()
            self._digests[key] = (hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), hashlib.sha256(data).hexdigest())
        return self._digests[key]

    def files(self, folder: Path) -> list[Path]:
        return sorted(path for path in folder.rglob("*") if path.is_file())

    def commit(self, folder: Path) -> str:
        """A 40-hex commit id that changes when any file does."""
        digest = hashlib.sha1()
        for path in self.files(folder):
            digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + self.digests(path)[1].encode())
        return digest.hexdigest()

    def model_info(self, repo_id: str, folder: Path) -> dict:
        siblings = []
        for path in self.files(folder):
            size, (blob_id, sha256) = path.stat().st_size, self.digests(path)
            siblings.append({
                "rfilename": path.relative_to(folder).as_posix(),
                "size": size,
                "blobId": blob_id,
                "lfs": {"sha256": sha256, "size": size, "pointerSize": 134},
            })  # fmt: skip
        info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": self.commit(folder), "private": repo_id in self.private,
                "tags": ["gguf"], "siblings": siblings}  # fmt: skip
        self.tamper.get(repo_id, lambda info: None)(info)
        return info


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the test reads `requests`

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        self.hub.requests.append((self.command, path))
        self.hub.authorizations.append(self.headers.get("Authorization", ""))
        if match := _INFO.fullmatch(path):
            return self._model_info(match["repo"], head)
        if match := _RESOLVE.fullmatch(path):
            return self._resolve(match["repo"], match["path"], head)
        self._error(404, "EntryNotFound", "no such endpoint", head)

    def _readable(self, repo_id: str, head: bool) -> Path | None:
        folder = self.hub.repo_dir(repo_id)
        token = self.hub.private.get(repo_id)
        if folder is None or (token is not None and self.headers.get("Authorization") != f"Bearer {token}"):
            self._error(401 if token else 404, "RepoNotFound", "Repository not found", head)
            return None
        if repo_id in self.hub.gated:
            self._error(403, "GatedRepo", "Access to this model is restricted", head)
            return None
        return folder

    def _model_info(self, repo_id: str, head: bool) -> None:
        if (folder := self._readable(repo_id, head)) is None:
            return
        body = json.dumps(self.hub.model_info(repo_id, folder)).encode()
        self._send(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body, head)

    def _resolve(self, repo_id: str, name: str, head: bool) -> None:
        if (folder := self._readable(repo_id, head)) is None:
            return
        file = folder / name
        if ".." in name.split("/") or not file.is_file():
            return self._error(404, "EntryNotFound", f"{name} does not exist", head)
        data = file.read_bytes() if not head else b""
        size, sha256 = file.stat().st_size, self.hub.digests(file)[1]
        headers = {
            "X-Repo-Commit": self.hub.commit(folder),
            "ETag": f'"{sha256}"',
            "X-Linked-Etag": f'"{sha256}"',
            "X-Linked-Size": str(size),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, body = 200, data
        if (match := _RANGE.fullmatch(self.headers.get("Range", ""))) and not head:
            start = int(match[1])
            end = int(match[2]) if match[2] else size - 1
            status, body = 206, data[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(len(body) if not head else size)
        self.hub.ranges.append(self.headers.get("Range", ""))
        if not head and status == 200 and f"{repo_id}/{name}" in self.hub.interrupt:
            self.hub.interrupt.discard(f"{repo_id}/{name}")
            body, self.close_connection = body[: len(body) // 2], True  # Content-Length promises more
        self._send(status, headers, body, head)

    def _error(self, status: int, code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json", "Content-Length": str(len(body))}
        self._send(status, headers, body, head)

    def _send(self, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)
