"""The chat page at `/` (for browsers) and its static files under /ui/; `/` stays plain text for other clients.

The files ship inside the package (corral/server/ui), so the page needs no build step. Only the names in
ASSETS are served: a request path never reaches the file system.
"""

from __future__ import annotations

import functools
import importlib.resources

import quart
from werkzeug.exceptions import NotFound

bp = quart.Blueprint("page", __name__)

ASSETS = {
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
# The page loads only its own files and talks only to this server: no inline script, nothing from elsewhere,
# so even a renderer bug could not run a model's output as code.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@functools.cache
def asset(name: str) -> bytes:
    """One of the page's packaged files."""
    return importlib.resources.files("corral.server").joinpath("ui").joinpath(name).read_bytes()


def wants_html() -> bool:
    """Whether the client prefers HTML to plain text (a browser does; curl sends */* and gets text)."""
    accept = quart.request.accept_mimetypes
    return accept.quality("text/html") > 0 and accept.best_match(["text/plain", "text/html"]) == "text/html"


@bp.get("/")
async def root():
    if wants_html():
        return asset("index.html"), 200, {"Content-Type": "text/html; charset=utf-8", "Vary": "Accept", **SECURITY_HEADERS}
    return "corral is running", 200, {"Content-Type": "text/plain; charset=utf-8", "Vary": "Accept"}


@bp.get("/ui/<name>")
async def ui_file(name: str):
    if name not in ASSETS:
        raise NotFound(f"no file {name!r} in the chat page")
    return asset(name), 200, {"Content-Type": ASSETS[name], "Cache-Control": "no-cache", **SECURITY_HEADERS}
