"""Browser and network safety: which web origins may call the API, which Host names a loopback server
answers (DNS rebinding), and the optional bearer key.

* Origins, as Ollama's OLLAMA_ORIGINS: a request without an `Origin` header (curl, the official clients) is
  not a browser's and passes; a browser's passes when its origin is loopback (any port), an app's
  (`app://`, `file://`, `tauri://`, `vscode-webview://` ...) or listed in CORRAL_ORIGINS / OLLAMA_ORIGINS
  (comma-separated, `*` wildcards). Any other origin gets a 403 and no CORS headers, preflight included.
* Host: a server bound to a loopback address answers only Host names that are this machine (localhost,
  loopback and private addresses, its hostname, `.localhost` / `.local` / `.internal` names), so a page on
  evil.example that resolves to 127.0.0.1 cannot drive it. A server bound elsewhere was exposed on purpose.
* CORRAL_API_KEY (like llama-server's and vLLM's --api-key): when set, every request but the liveness
  routes (`/`, `/health`) and CORS preflights needs `Authorization: Bearer <key>`, else 401.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import os
import socket

import attrs

from corral.address import is_loopback_host

API_KEY_ENV = "CORRAL_API_KEY"
ORIGINS_ENVS = ("CORRAL_ORIGINS", "OLLAMA_ORIGINS")

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
DEFAULT_ORIGINS = (
    *(f"{scheme}://{name}{port}" for scheme in ("http", "https") for name in _LOOPBACK_NAMES for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)  # fmt: skip
OPEN_PATHS = ("/", "/health")  # liveness probes need no key
ALLOWED_HEADERS = "Authorization, Content-Type, Accept, User-Agent, X-Requested-With, OpenAI-Organization, OpenAI-Project"
ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


class Refusal(Exception):
    """A request the guard refuses: `status` (401, 403) and a message that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def is_loopback_bind(host: str) -> bool:
    """Whether a bind address is reachable only from this machine."""
    return is_loopback_host(host)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server other machines can reach with no key; None when there is nothing to say."""
    if is_loopback_bind(host) or api_key:
        return None
    return (
        f"corral is listening on {host}, reachable from other machines, and no {API_KEY_ENV} is set: anyone who"
        f" can reach this address can run and delete models. Set {API_KEY_ENV}, or bind to 127.0.0.1."
    )


@attrs.frozen
class Guard:
    """What one server allows: its extra origins, whether Host is checked, and its key."""

    origins: tuple[str, ...] = DEFAULT_ORIGINS
    check_host: bool = True
    api_key: str | None = attrs.field(default=None, repr=False)  # never printed

    @classmethod
    def from_env(cls, bind_host: str) -> Guard:
        """The guard for a server bound to `bind_host`, from CORRAL_ORIGINS, OLLAMA_ORIGINS and CORRAL_API_KEY."""
        extra = [item.strip() for env in ORIGINS_ENVS for item in os.environ.get(env, "").split(",") if item.strip()]
        return cls(DEFAULT_ORIGINS + tuple(extra), is_loopback_bind(bind_host), os.environ.get(API_KEY_ENV) or None)

    def origin_allowed(self, origin: str) -> bool:
        """Whether a browser page from `origin` may call the API."""
        origin = origin.strip().lower().rstrip("/")
        return any(fnmatch.fnmatchcase(origin, pattern.lower().rstrip("/")) for pattern in self.origins)

    def host_allowed(self, host: str) -> bool:
        """Whether a `Host` header names this machine (always true when Host is not checked)."""
        if not self.check_host or not host:
            return True
        name = _host_name(host).lower()
        if name in ("localhost", socket.gethostname().lower()) or name.endswith(_LOCAL_SUFFIXES):
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return address.is_loopback or address.is_private or address.is_unspecified

    def check(self, method: str, path: str, headers: dict[str, str]) -> None:
        """Raise Refusal unless the request may go on (`headers`: case-insensitive, as Quart's)."""
        if not self.host_allowed(headers.get("Host", "")):
            raise Refusal(403, "this server answers only requests addressed to this machine (the Host header names another)")
        origin = headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin):
            raise Refusal(403, f"origin {origin!r} is not allowed: add it to CORRAL_ORIGINS (or OLLAMA_ORIGINS)")
        if self.api_key is None or path in OPEN_PATHS or is_preflight(method, headers):
            return
        scheme, _, given = headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise Refusal(401, f"missing or wrong API key: send Authorization: Bearer <{API_KEY_ENV}>")

    def cors_headers(self, origin: str | None) -> dict[str, str]:
        """The CORS headers of a response to a browser request from an allowed `origin`."""
        if origin is None or not self.origin_allowed(origin):
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": "600",
            "Vary": "Origin",
        }


def is_preflight(method: str, headers: dict[str, str]) -> bool:
    """A CORS preflight: OPTIONS naming the method the browser wants to send."""
    return method == "OPTIONS" and "Access-Control-Request-Method" in headers


def _host_name(host: str) -> str:
    """The name in a Host header, less its port: "[::1]:11434" -> "::1", "localhost:80" -> "localhost"."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else host
