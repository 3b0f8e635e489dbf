"""Plugin discovery: one PluginManager per runtime, loaded lazily from the `corral` entry points.

(The module is `corral.registry` because `corral.plugins` is the package of built-in plugins.)
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import types
from typing import Any

import attrs
import pluggy

from corral import hookspecs
from corral.errors import CorralError, UnknownArchitectureError
from corral.gguf import GGUFFile

ENTRY_POINT_GROUP = "corral"
ALLOW_ENV = "CORRAL_LOAD_PLUGINS"
KINDS = ("architectures", "backends", "samplers", "tool_parsers", "vision_encoders")

log = logging.getLogger(__name__)


@attrs.frozen
class PluginInfo:
    """What `corral plugins` shows for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    registers: dict[str, tuple[str, ...]]


def allow_list_from_env() -> frozenset[str] | None:
    """Plugin names allowed by CORRAL_LOAD_PLUGINS (comma-separated); None when unset (load all)."""
    value = os.environ.get(ALLOW_ENV)
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


class Plugins:
    """The plugins of one runtime: entry points are imported on first use, never at import time."""

    def __init__(self, allow: frozenset[str] | None = None, *, entry_points: bool = True):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self._allow = allow if allow is not None else allow_list_from_env()
        self._entry_points = entry_points
        self._loaded = False
        self._dists: dict[str, importlib.metadata.Distribution | None] = {}

    def register(self, plugin: types.ModuleType | object, name: str | None = None) -> str:
        """Register a plugin object by hand (tests, embedding applications)."""
        self._ensure_loaded()
        return self.pm.register(plugin, name=name)

    def unregister(self, name: str) -> None:
        """Remove a plugin registered earlier."""
        self.pm.unregister(name=name)

    def architectures(self) -> dict[str, Any]:
        """Architecture name -> model class."""
        return self._collect("register_architectures")

    def backends(self) -> dict[str, Any]:
        """Backend name -> backend class."""
        return self._collect("register_backends")

    def architecture_for(self, gguf: GGUFFile) -> type:
        """The model class for the file's `general.architecture`; UnknownArchitectureError if none is installed."""
        architectures = self.architectures()
        if gguf.architecture not in architectures:
            known = ", ".join(sorted(architectures)) or "none"
            raise UnknownArchitectureError(
                f"{gguf.path}: architecture '{gguf.architecture}' is not supported (known: {known}); "
                "a plugin package may provide it (see `corral plugins`)"
            )
        return architectures[gguf.architecture]

    def open_backend(self, name: str | None = None, *, device: str | None = None, precision: str = "auto") -> Any:
        """A new instance of the installed backend `name`; by default the one with the highest `priority`.

        A backend class may set `priority` (an int, 0 when absent); ties go to the first name in order.
        """
        backends = self.backends()
        if name is None and backends:
            name = max(sorted(backends), key=lambda key: getattr(backends[key], "priority", 0))
        if name not in backends:
            raise CorralError(f"backend '{name}' is not installed (installed: {', '.join(sorted(backends)) or 'none'})")
        return backends[name](device=device, precision=precision)

    def samplers(self) -> dict[str, Any]:
        """Sampler name -> sampler class."""
        return self._collect("register_samplers")

    def tool_parsers(self) -> dict[str, Any]:
        """Tool-call family name -> parser class."""
        return self._collect("register_tool_parsers")

    def vision_encoders(self) -> dict[str, Any]:
        """Projector type (`clip.projector_type`) -> vision encoder class."""
        return self._collect("register_vision_encoders")

    def vision_encoder_for(self, gguf: GGUFFile) -> type:
        """The vision encoder class for a projector file; UnknownArchitectureError if none is installed."""
        encoders = self.vision_encoders()
        kind = gguf.metadata.get("clip.projector_type")
        if gguf.architecture != "clip" or kind is None:
            raise UnknownArchitectureError(f"{gguf.path}: not a vision projector (a `clip` file with `clip.projector_type`)")
        if kind not in encoders:
            known = ", ".join(sorted(encoders)) or "none"
            raise UnknownArchitectureError(
                f"{gguf.path}: vision projector '{kind}' is not supported (known: {known}); a plugin package may provide it"
            )
        return encoders[kind]

    def describe(self) -> list[PluginInfo]:
        """Every loaded plugin with its distribution, version and what it registers."""
        self._ensure_loaded()
        infos = []
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda item: item[0]):
            registers = {}
            for kind in KINDS:
                names: list[str] = []
                hook = getattr(plugin, f"register_{kind}", None)
                if hook is not None:
                    hook(register=lambda key, _value, _names=names: _names.append(key))
                if names:
                    registers[kind] = tuple(names)
            dist = self._dists.get(name)
            infos.append(
                PluginInfo(name, dist.metadata["Name"] if dist else None, dist.version if dist else None, registers)
            )
        return infos

    def _collect(self, hook_name: str) -> dict[str, Any]:
        self._ensure_loaded()
        found: dict[str, Any] = {}

        def register(name: str, value: Any) -> None:
            found.setdefault(name, value)

        # pluggy calls the most recently registered plugin first, so a later plugin overrides a built-in.
        getattr(self.pm.hook, hook_name)(register=register)
        return found

    def _ensure_loaded(self) -> None:
        if self._loaded or not self._entry_points:
            self._loaded = True
            return
        self._loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist else None
            if self._allow is not None and ep.name not in self._allow and dist_name not in self._allow:
                continue
            if self.pm.get_plugin(ep.name) is not None:
                continue
            try:
                module = ep.load()
            except Exception:
                log.exception("plugin %r (%s) failed to import; skipping it", ep.name, dist_name)
                continue
            self.pm.register(module, name=ep.name)
            self._dists[ep.name] = dist


