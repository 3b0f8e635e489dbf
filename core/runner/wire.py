"""The runner's wire format: JSON lines over a loopback stream, chunks and errors as JSON.

Shared by the runner process (`python -m corral.runner`) and the server's RunnerProcess client.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import attrs

from corral.errors import CorralError
from corral.runner.stream import Chunk, TokenLogprob

MAX_LINE = 256 << 20


class RunnerError(CorralError):
    """The runner process failed; the request could not complete."""


class JsonLines:
    """JSON values, one per line, over a Trio byte stream."""

    def __init__(self, stream: Any):
        self.stream = stream
        self._buffer = bytearray()
        self._scanned = 0

    async def receive_line(self) -> bytes | None:
        """The next line without its newline; None at the end of the stream."""
        while True:
            end = self._buffer.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                self._scanned = 0
                return line
            self._scanned = len(self._buffer)
            if self._scanned > MAX_LINE:
                raise RunnerError(f"a line from the runner is longer than {MAX_LINE} bytes")
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return None
            self._buffer += data

    async def receive(self) -> Any:
        """The next value; None at the end of the stream."""
        line = await self.receive_line()
        return None if line is None else json.loads(line)

    async def send(self, value: Any) -> None:
        await self.stream.send_all(json.dumps(value).encode() + b"\n")


def chunk_to_json(chunk: Chunk) -> dict:
    """A chunk as JSON-ready values."""
    return attrs.asdict(chunk)


_CHUNK_FIELDS = frozenset(field.name for field in attrs.fields(Chunk))


def chunk_from_json(data: dict) -> Chunk:
    """The chunk `chunk_to_json` described."""
    fields = {key: value for key, value in data.items() if key in _CHUNK_FIELDS}
    fields["token_ids"] = tuple(fields.get("token_ids", ()))
    fields["context"] = tuple(fields.get("context", ()))
    fields["logprobs"] = tuple(
        TokenLogprob(lp["token"], lp["text"], lp["logprob"], tuple(tuple(top) for top in lp.get("top", ())))
        for lp in fields.get("logprobs", ())
    )
    return Chunk(**fields)


def error_to_json(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


_BUILTIN_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, KeyError, RuntimeError, NotImplementedError)}


def error_from_json(data: dict) -> Exception:
    """The child's error as the same type here when it is a corral error (so it maps to the same status)."""
    name, message = str(data.get("type", "")), str(data.get("message", ""))
    cls = _corral_errors().get(name) or _BUILTIN_ERRORS.get(name)
    if cls is not None:
        try:
            return cls(message)
        except TypeError:
            pass
    return RunnerError(f"{name}: {message}" if name else message)


def _corral_errors() -> dict[str, type[CorralError]]:
    found, todo = {}, [CorralError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def images_to_json(images: Any) -> list[str]:
    """Image files' bytes as base64 text for the wire."""
    return [base64.b64encode(bytes(data)).decode("ascii") for data in images or ()]


def images_from_json(op: str, args: dict) -> dict:
    """A generate or chat call's arguments with its images (base64 on the wire) back as bytes."""
    if op == "generate":
        return {**args, "images": [base64.b64decode(text) for text in args.get("images") or ()]}
    messages = [{**m, "images": [base64.b64decode(text) for text in m["images"]]} if m.get("images") else m for m in args.get("messages") or ()]
    return {**args, "messages": messages}
