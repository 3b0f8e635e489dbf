"""What the handlers refuse rather than silently drop: inputs a model cannot take, fields corral does not do.

A request that carries something the API documents but corral (or the model) cannot honour gets a 400 that
names it, never a reply that pretends it was used (a text-only model describing an image it never saw).
"""

from __future__ import annotations

from typing import Any

import trio

from corral.server.http import ApiError
from corral.server.state import model_capabilities, state


async def refuse_images(model: str) -> None:
    """400 unless the model can see: corral has no vision projector yet, so no model can (capability "vision")."""
    capabilities = await trio.to_thread.run_sync(model_capabilities, state().store, model)
    if "vision" not in capabilities:
        raise ApiError(400, f'"{model}" does not support images')


def refuse_fields(body: dict, unsupported: dict[str, tuple[Any, str]]) -> None:
    """400 for a field set to anything but its harmless value: `unsupported[name] = (harmless, why)`; None and
    the harmless value (an empty list, false, 1 ...) pass."""
    for name, (harmless, why) in unsupported.items():
        value = body.get(name)
        if value is not None and value != harmless and not (isinstance(harmless, tuple) and value in harmless):
            raise ApiError(400, f"{name} is not supported: {why}")
