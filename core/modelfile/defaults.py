"""A model's defaults read back from its layers: options, SYSTEM, TEMPLATE, MESSAGES and LICENSE."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import attrs

from corral.errors import ModelNotFoundError
from corral.modelfile.syntax import IGNORED_PARAMETERS, Message, Modelfile, render_value
from corral.options import STANDARD_OPTIONS, InvalidOptionError, parse_options
from corral.store import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    Layer,
    ModelName,
    Store,
    parse_name,
)

log = logging.getLogger(__name__)


@attrs.frozen
class ModelDefaults:
    """What a model's layers say a request defaults to: options, system message, template, messages."""

    options: dict[str, Any] = attrs.field(factory=dict)  # raw option values, as a request's `options`
    system: str | None = None
    template: str | None = None
    messages: tuple[Message, ...] = ()
    license: tuple[str, ...] = ()

    def merge_options(self, request: dict[str, Any] | None) -> dict[str, Any]:
        """A request's options over these defaults (a null in the request keeps the default)."""
        given = {name: value for name, value in (request or {}).items() if value is not None}
        return self.options | given

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """A chat's messages behind the MESSAGEs, with the SYSTEM message first unless the chat starts with its own
        (Ollama's rule: a system message later in the chat does not replace the model's)."""
        preamble = [message.to_json() for message in self.messages]
        starts_with_system = (messages or preamble or [{}])[0].get("role") == "system"
        if self.system and not starts_with_system:
            preamble.insert(0, {"role": "system", "content": self.system})
        return preamble + messages

    def chat_template(self, model: str) -> str | None:
        """The TEMPLATE to render `model`'s chats with instead of its file's (Jinja or Ollama's Go: corral.template decides)."""
        return self.template or None

    def to_modelfile(self, from_: str, projector: str | None = None) -> Modelfile:
        """The Modelfile that recreates the model from `from_` and its `projector` (what /api/show prints)."""
        parameters = {name: self.options[name] for name in STANDARD_OPTIONS if name in self.options}
        return Modelfile(from_, parameters, self.template, self.system, self.messages, self.license, projector)


def model_defaults(store: Store, name: str | ModelName) -> ModelDefaults:
    """The defaults stored in a model's params, system, template, messages and license layers.

    A layer that cannot be read or holds a bad value is skipped with a warning: defaults never make a
    request fail. Blocking (a few small files): from Trio, call it in a thread or cache it by manifest digest.
    """
    model_name = parse_name(name)
    manifest = store.manifest(model_name)
    if manifest is None:
        raise ModelNotFoundError(f"model '{model_name}' not found")
    found: dict[str, Any] = {"license": []}
    for layer in manifest.layers:
        if layer.media_type == PARAMS_MEDIA_TYPE:
            found["options"] = _valid_options(_read_json(store, layer), model_name)
        elif layer.media_type == MESSAGES_MEDIA_TYPE:
            found["messages"] = _valid_messages(_read_json(store, layer), model_name)
        elif layer.media_type in (SYSTEM_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE, LICENSE_MEDIA_TYPE):
            text = _read_text(store, layer)
            if text is None:
                continue
            if layer.media_type == LICENSE_MEDIA_TYPE:
                found["license"].append(text)
            else:
                found[layer.media_type.rsplit(".", 1)[1]] = text
    found["license"] = tuple(found["license"])
    return ModelDefaults(**found)


def stored_parameters(store: Store, layers: Iterable[Layer]) -> dict[str, Any]:
    """The params layer among `layers` as stored (not validated): what a derived model's parameters merge over."""
    layer = next((layer for layer in layers if layer.media_type == PARAMS_MEDIA_TYPE), None)
    if layer is None:
        return {}
    value = _read_json(store, layer)
    return value if isinstance(value, dict) else {}


def _read_text(store: Store, layer: Layer) -> str | None:
    try:
        return store.blob_path(layer.digest).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        log.warning("skipping %s layer %s: %s", layer.media_type, layer.digest, error)
        return None


def _read_json(store: Store, layer: Layer) -> Any:
    text = _read_text(store, layer)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        log.warning("skipping %s layer %s: not JSON (%s)", layer.media_type, layer.digest, error)
        return None


def _valid_options(raw: Any, model: ModelName) -> dict[str, Any]:
    if not isinstance(raw, dict):
        return {}
    options = {}
    for name, value in raw.items():
        if name not in STANDARD_OPTIONS:
            if name not in IGNORED_PARAMETERS:
                log.warning("model %s: ignoring unknown parameter %r", model, name)
            continue
        try:
            parse_options({name: value})
        except InvalidOptionError as error:
            log.warning("model %s: ignoring parameter: %s", model, error)
            continue
        options[name] = value
    return options


def _valid_messages(raw: Any, model: ModelName) -> tuple[Message, ...]:
    try:
        return tuple(Message.from_json(item) for item in (raw if isinstance(raw, list) else ()))
    except ValueError as error:
        log.warning("model %s: ignoring its messages: %s", model, error)
        return ()


def format_parameters(options: dict[str, Any]) -> str:
    """Options as /api/show's `parameters` text: one `name value` line each, strings quoted, as Ollama does."""
    lines = []
    for name, value in options.items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            shown = json.dumps(item) if isinstance(item, str) else render_value(item)
            lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)
