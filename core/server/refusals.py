"""What the handlers refuse rather than silently drop: inputs a model cannot take, fields corral does not do.

A request that carries something the API documents but corral (or the model) cannot honour gets a 400 that
names it, never a reply that pretends it was used (a text-only model describing an image it never saw).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import trio

from corral.server.http import ApiError
from corral.server.state import model_capabilities, state


async def refuse_images(model: str) -> None:
    """400 unless the model can see: a vision projector in its manifest (capability "vision")."""
    capabilities = await trio.to_thread.run_sync(model_capabilities, state().store, model)
    if "vision" not in capabilities:
        raise ApiError(400, f'"{model}" does not support images')


def decode_base64_images(images: Any, where: str = "images") -> list[bytes]:
    """Ollama's `images`: a list of base64 strings (a data: URL prefix is tolerated) -> their bytes; 400 otherwise."""
    if not isinstance(images, list):
        raise ApiError(400, f"{where} must be a list of base64-encoded images")
    out = []
    for index, item in enumerate(images):
        if not isinstance(item, str):
            raise ApiError(400, f"{where}[{index}] must be a base64-encoded image string")
        text = item.split(",", 1)[1] if item.startswith("data:") and "," in item else item
        try:
            out.append(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}[{index}] is not valid base64") from None
    return out


def refuse_fields(body: dict, unsupported: dict[str, tuple[Any, str]]) -> None:
    """400 for a field set to anything but its harmless value: `unsupported[name] = (harmless, why)`; None and
    the harmless value (an empty list, false, 1 ...) pass."""
    for name, (harmless, why) in unsupported.items():
        value = body.get(name)
        if value is not None and value != harmless and not (isinstance(harmless, tuple) and value in harmless):
            raise ApiError(400, f"{name} is not supported: {why}")
