"""What every request handler reaches: the scheduler, the store, metrics, and model descriptions."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import quart

from corral.model_info import parameter_count, quantization_name
from corral.gguf import GGUFFile
from corral.modelfile.defaults import model_defaults
from corral.scheduler import Scheduler
from corral.server.http import ApiError
from corral.store import Store
from corral.template import renders_suffix, renders_tools
from corral.thinking import can_think


@attrs.define
class ServerState:
    scheduler: Scheduler
    store: Store
    metrics: Any = None
    nursery: Any = None  # the server's nursery, for work that outlives a request handler (pulls)
    _details: dict[str, dict] = attrs.field(factory=dict)

    def require_capability(self, name: str, capability: str) -> None:
        """400 unless the model `name` has `capability` (e.g. "tools")."""
        if capability not in model_capabilities(self.store, name):
            raise ApiError(400, f'"{name}" does not support {capability}')

    def details(self, path: Any, digest: str) -> dict:
        """Ollama's `details` object for a GGUF file, cached by blob digest."""
        if digest not in self._details:
            self._details[digest] = describe_gguf(path)
        return self._details[digest]


def state() -> ServerState:
    """The running app's ServerState."""
    return quart.current_app.extensions["corral"]


def model_capabilities(store: Store, name: str) -> list[str]:
    """What a model can do: "embedding" alone for a model whose file names a pooling (as Ollama decides);
    otherwise "completion", "tools" when its chat template renders tools, "insert" when it renders a
    suffix, "thinking" when it has a thinking switch or markers, "vision" when it has a projector layer."""
    if _file_pools(str(store.model_path(name))):
        return ["embedding"]
    template = model_template_source(store, name)
    return (["completion"] + (["tools"] if renders_tools(template) else []) + (["insert"] if renders_suffix(template) else [])
            + (["thinking"] if can_think(template) else []) + (["vision"] if store.projector_path(name) else []))


def model_template_source(store: Store, name: str) -> str:
    """The model's chat template: its Modelfile TEMPLATE, else its file's."""
    return model_defaults(store, name).template or _file_template(str(store.model_path(name)))


@functools.lru_cache(maxsize=64)
def _file_template(blob: str) -> str:
    # Blobs are named by their digest, so a path's template never changes; opening a GGUF costs a few hundred ms.
    return GGUFFile.open(blob).get("tokenizer.chat_template", "")


@functools.lru_cache(maxsize=64)
def _file_pools(blob: str) -> bool:
    # Whether the file names a pooling (`<arch>.pooling_type`): an embedding model. Cached like the template.
    gguf = GGUFFile.open(blob)
    return bool(gguf.get(f"{gguf.architecture}.pooling_type", 0))


def describe_gguf(path: Any) -> dict:
    """format, family, families, parameter_size and quantization_level of a GGUF file."""
    gguf = GGUFFile.open(path)
    arch = gguf.architecture
    return {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch],
        "parameter_size": format_parameter_size(parameter_count(gguf)),
        "quantization_level": quantization_name(gguf),
    }


_SIZE_SUFFIXES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))


def format_parameter_size(count: int) -> str:
    """134515008 -> "134.52M", as Ollama shows parameter sizes."""
    for scale, suffix in _SIZE_SUFFIXES:
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + suffix
    return str(count)
