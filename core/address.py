"""The server's address from CORRAL_HOST (or OLLAMA_HOST), shared by `corral serve` and the client."""

from __future__ import annotations

import ipaddress
import os

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434


def address_from_env() -> tuple[str, str, int]:
    """(scheme, host, port) from CORRAL_HOST or OLLAMA_HOST ("host", "host:port", "[::1]:port", with or
    without http(s)://); 127.0.0.1:11434 over http by default."""
    value = os.environ.get("CORRAL_HOST") or os.environ.get("OLLAMA_HOST") or ""
    scheme = "https" if value.startswith("https://") else "http"
    value = value.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, port = value, DEFAULT_PORT
    head, sep, tail = value.rpartition(":")
    if sep and tail.isdigit() and (head.startswith("[") or ":" not in head):
        host, port = head, int(tail)
    return scheme, host.strip("[]") or DEFAULT_HOST, port


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address (IPv6 in brackets or not) reaches only this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
