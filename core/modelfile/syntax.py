"""Modelfiles: Ollama's recipe for a model, the layers `create` turns it into, and the defaults read back.

    FROM ./SmolLM2.gguf              # a GGUF file (relative to the Modelfile) or a model in the store
    PARAMETER temperature 0.2
    PARAMETER stop "<|im_end|>"
    SYSTEM \"\"\"You answer in one sentence.\"\"\"
    MESSAGE user Is the sky blue?
    MESSAGE assistant Yes.

Parsing follows Ollama's rules: instruction names are case-insensitive, `#` starts a comment only at the
start of a line, a value runs to the end of its line unless it is quoted, and a quoted value (`"..."` or
`\"\"\"...\"\"\"`) may span lines and ends at the first line end where the closing quotes stand. There are
no escapes, so a value with a line ending in `\"\"\"` cannot be written in a Modelfile (nor in Ollama's).

A created model is its base's layers with some replaced: `template`, `system` (text), `params` (a JSON
object of option -> value, merged key by key over the base's), `messages` (a JSON list of
{role, content}) and `license` (one text per layer, added to the base's). `model_defaults` reads them back.
TEMPLATE text is stored as given: corral renders Jinja (Hugging Face chat templates), and Ollama's own
Modelfiles carry Go templates; `is_go_template` tells the two apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from corral.errors import CorralError, GGUFError, ModelNotFoundError
from corral.gguf import GGUFFile
from corral.options import STANDARD_OPTIONS, InvalidOptionError, parse_option_text, parse_options
from corral.store import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    MODEL_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    Layer,
    Manifest,
    ModelName,
    Store,
    parse_digest,
    parse_name,
)

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant")
# Ollama parameters corral has no use for: Ollama's deprecated ones and its GPU placement knobs. A
# Modelfile written for Ollama may carry them, so they are dropped with a warning instead of refused.
IGNORED_PARAMETERS = frozenset(
    {
        "penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock",
        "mirostat", "mirostat_tau", "mirostat_eta", "main_gpu", "use_mmap", "numa",
    }
)  # fmt: skip
_INSTRUCTIONS = ("from", "parameter", "template", "system", "message", "license")
_UNSUPPORTED = {
    "adapter": "ADAPTER is not supported: corral cannot apply LoRA adapters; merge the adapter into "
    "the GGUF (llama.cpp's llama-export-lora) and use FROM with the merged file",
    "draft": "DRAFT is not supported: corral has no speculative decoding",
    "renderer": "RENDERER is not supported by corral",
    "parser": "PARSER is not supported by corral",
    "requires": "REQUIRES is not supported by corral",
}
_GO_ACTION = re.compile(r"\{\{-?\s*(\.|\$|(range|if|with|else|end|template|define|block)\b)")


class ModelfileError(CorralError):
    """A Modelfile that cannot be parsed; the message names the line."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(f"Modelfile line {line}: {message}" if line else f"Modelfile: {message}")
        self.line = line


class CreateModelError(CorralError):
    """A model cannot be created from what was given: an unusable GGUF, a bad message, a missing part."""


@attrs.frozen
class Message:
    """A message a model starts every chat with (MESSAGE)."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@attrs.frozen
class Modelfile:
    """A parsed Modelfile; `parameters` holds typed option values (`stop` a list), ready for JSON."""

    from_: str
    parameters: dict[str, Any] = attrs.field(factory=dict)
    template: str | None = None
    system: str | None = None
    messages: tuple[Message, ...] = ()
    license: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Modelfile:
        """Parse Modelfile text; ModelfileError says what is wrong and on which line."""
        return _Parser(text).modelfile()

    @classmethod
    def read(cls, path: str | os.PathLike) -> Modelfile:
        """Parse a Modelfile on disk."""
        return cls.parse(Path(path).read_text(encoding="utf-8"))

    def render(self) -> str:
        """The Modelfile as text that parses back to an equal Modelfile."""
        lines = [f"FROM {self.from_}"]
        if self.template is not None:
            lines.append(f"TEMPLATE {_quote(self.template)}")
        if self.system is not None:
            lines.append(f"SYSTEM {_quote(self.system)}")
        for name, value in self.parameters.items():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                lines.append(f"PARAMETER {name} {_quote(_format_value(item))}")
        lines += [f"LICENSE {_quote(text)}" for text in self.license]
        lines += [f"MESSAGE {m.role} {_quote(m.content)}" for m in self.messages]
        return "\n".join(lines) + "\n"

    def to_spec(self, directory: str | os.PathLike | None = None) -> ModelSpec:
        """What to create: FROM is a GGUF file (relative to `directory`) when it names one, else a model."""
        source = _resolve_from(self.from_, directory)
        base = {"gguf_path": source} if isinstance(source, Path) else {"from_model": source}
        return ModelSpec(
            **base,
            template=self.template,
            system=self.system,
            parameters=dict(self.parameters) if self.parameters else None,
            messages=self.messages,
            license=self.license,
        )


class _Parser:
    """Ollama's Modelfile grammar over the whole text, tracking the line number."""

    def __init__(self, text: str):
        self.text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
        self.pos = 0
        self.line = 1

    def modelfile(self) -> Modelfile:
        found: dict[str, Any] = {"parameters": {}, "messages": [], "license": []}
        while (word := self._next_word()) is not None:
            line, instruction = self.line, word.lower()
            if instruction in _UNSUPPORTED:
                raise ModelfileError(_UNSUPPORTED[instruction], line)
            if instruction not in _INSTRUCTIONS:
                known = ", ".join(name.upper() for name in _INSTRUCTIONS)
                raise ModelfileError(f"unknown instruction {word!r}: use one of {known}", line)
            if instruction == "parameter":
                name = self._word(f"{word} needs a name and a value, as in PARAMETER temperature 0.7").lower()
                _add_parameter(found["parameters"], name, self._value(f"{word} {name}"), line)
            elif instruction == "message":
                role = self._word(f"{word} needs a role and a content, as in MESSAGE user Hello").lower()
                if role not in MESSAGE_ROLES:
                    raise ModelfileError(f"message role {role!r} must be one of {', '.join(MESSAGE_ROLES)}", line)
                found["messages"].append(Message(role, self._value(f"{word} {role}")))
            elif instruction == "from":
                if "from_" in found:
                    raise ModelfileError("a Modelfile has one FROM; remove the extra one", line)
                found["from_"] = self._value(word)
            elif instruction == "license":
                found["license"].append(self._value(word))
            else:
                found[instruction] = self._value(word)  # the last TEMPLATE or SYSTEM wins, as in Ollama
        if "from_" not in found:
            raise ModelfileError("no FROM line: start with FROM <model name or GGUF path>")
        found["messages"], found["license"] = tuple(found["messages"]), tuple(found["license"])
        return Modelfile(**found)

    def _next_word(self) -> str | None:
        """The next instruction name, skipping blank lines and comments; None at the end."""
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\n":
                self.line += 1
                self.pos += 1
            elif char in " \t":
                self.pos += 1
            elif char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return self._word("")
        return None

    def _word(self, missing: str) -> str:
        """A run of non-blank characters on the current line."""
        self._skip_blanks()
        start = self.pos
        while self.pos < len(self.text) and not self.text[self.pos].isspace():
            self.pos += 1
        if self.pos == start:
            raise ModelfileError(missing, self.line)
        return self.text[start : self.pos]

    def _value(self, what: str) -> str:
        """The argument: the rest of the line, or a quoted value ending at a line end after its closing quotes."""
        self._skip_blanks()
        if self.pos >= len(self.text) or self.text[self.pos] == "\n":
            raise ModelfileError(f"{what} needs a value", self.line)
        start, first_line = self.pos, self.line
        while True:
            end = self.text.find("\n", self.pos)
            end = len(self.text) if end < 0 else end
            value = _unquote(self.text[start:end].strip())
            if value is not None:
                self.pos = end
                return value
            if end == len(self.text):
                quotes = '"""' if self.text.startswith('"""', start) else '"'
                raise ModelfileError(f"{what}: the value opened with {quotes} is never closed", first_line)
            self.pos = end + 1
            self.line += 1

    def _skip_blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1


def _unquote(text: str) -> str | None:
    """The value inside its quotes; None while the closing quotes have not been reached."""
    if text.startswith('"""'):
        return text[3:-3] if len(text) >= 6 and text.endswith('"""') else None
    if text.startswith('"'):
        return text[1:-1] if len(text) >= 2 and text.endswith('"') else None
    return text


def _quote(text: str) -> str:
    # Bare when it parses back unchanged; quoted when blanks at the ends, line breaks or a leading quote
    # would change it. `\"\"\"` when the text holds a quote itself, as Ollama writes it.
    if text and text.strip() == text and "\n" not in text and not text.startswith('"'):
        return text
    return f'"""{text}"""' if '"' in text else f'"{text}"'


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _add_parameter(parameters: dict[str, Any], name: str, text: str, line: int) -> None:
    if name in IGNORED_PARAMETERS:
        log.warning("Modelfile line %d: ignoring parameter %r, which corral does not use", line, name)
        return
    try:
        value = parse_option_text(name, text)
    except InvalidOptionError as error:
        raise ModelfileError(str(error), line) from None
    if isinstance(value, list):
        parameters.setdefault(name, []).extend(value)
    else:
        parameters[name] = value  # the last one wins, as in Ollama


def _checked_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Option values validated by `parse_options`, as JSON-ready values (`stop` a list)."""
    options = parse_options(raw)
    return {name: _jsonable(options.get(name)) for name in raw}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def validate_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """A create request's `parameters`: names must be options, values valid; returns JSON-ready values."""
    if not isinstance(raw, dict):
        raise InvalidOptionError("parameters must be an object mapping option names to values")
    known = {}
    for name, value in raw.items():
        if value is None:
            continue
        if name in IGNORED_PARAMETERS:
            log.warning("ignoring parameter %r, which corral does not use", name)
        elif name not in STANDARD_OPTIONS:
            raise InvalidOptionError(f"unknown parameter {name!r}: use one of {', '.join(STANDARD_OPTIONS)}")
        else:
            known[name] = value
    return _checked_parameters(known)


def parse_messages(raw: Iterable[Any]) -> tuple[Message, ...]:
    """A create request's `messages`: objects with a role (system, user, assistant) and a string content."""
    messages = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("content", ""), str):
            raise CreateModelError(f"messages[{index}] must be an object with a role and a string content")
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise CreateModelError(f"messages[{index}]: role {role!r} must be one of {', '.join(MESSAGE_ROLES)}")
        messages.append(Message(role, item.get("content") or ""))
    return tuple(messages)


def is_go_template(text: str) -> bool:
    """Whether a template is Go template syntax (`{{ .Prompt }}`, `{{ range .Messages }}`), not Jinja."""
    return bool(_GO_ACTION.search(text))


def _resolve_from(value: str, directory: str | os.PathLike | None) -> str | Path:
    """A FROM argument as a GGUF path (absolute) or a model name."""
    looks_like_path = value.startswith(("/", "./", "../", "~")) or value.lower().endswith(".gguf")
    path = Path(value).expanduser()
    if not path.is_absolute():
        if directory is None:
            if looks_like_path:
                raise ModelfileError(
                    f"FROM {value}: a relative path needs the Modelfile's directory; give an absolute path"
                )
            return value
        path = Path(directory) / path
    if path.is_dir():
        raise ModelfileError(f"FROM {value}: {path} is a directory; corral creates models from one GGUF file")
    if path.is_file():
        return path.resolve()
    if looks_like_path:
        raise ModelfileError(f"FROM {value}: no such file {path}")
    return value


# --- creating a model -----------------------------------------------------------------------------------


@attrs.frozen
class ModelSpec:
    """What `create_model` builds: one base (a model in the store, an uploaded GGUF blob or a GGUF file on
    this machine) and the layers that replace the base's; None keeps the base's layer, "" removes it."""

    from_model: str | None = None
    gguf_blob: str | None = None
    gguf_path: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None  # JSON-ready, as `validate_parameters` returns them
    messages: tuple[Message, ...] = ()  # empty: keep the base's
    license: tuple[str, ...] = ()  # added to the base's

    def __attrs_post_init__(self) -> None:
        given = [v for v in (self.from_model, self.gguf_blob, self.gguf_path) if v is not None]
        if len(given) != 1:
            raise CreateModelError("give exactly one base: `from` (a model name) or `files` (an uploaded GGUF)")


Progress = Callable[[dict], None]


def check_spec(store: Store, spec: ModelSpec) -> tuple[Layer, ...]:
    """Validate a spec without writing anything; returns the base model's layers (empty for a GGUF)."""
    if spec.from_model is not None:
        base = parse_name(spec.from_model)
        manifest = store.manifest(base)
        if manifest is None or manifest.model is None:
            raise ModelNotFoundError(f"model '{base}' not found; pull or create it first")
        if not store.has_blob(manifest.model.digest):
            raise ModelNotFoundError(f"model '{base}' is missing its GGUF blob; pull it again")
        return manifest.layers
    if spec.gguf_blob is not None:
        digest = parse_digest(spec.gguf_blob)
        if not store.has_blob(digest):
            raise CreateModelError(f"blob {digest} is not in the store; upload it with POST /api/blobs/{digest}")
        _check_gguf(store.blob_path(digest), f"the uploaded file {digest}")
    else:
        _check_gguf(spec.gguf_path, str(spec.gguf_path))
    return ()


def _check_gguf(path: Path, what: str) -> None:
    try:
        gguf = GGUFFile.open(path)
        try:
            gguf.architecture
        finally:
            gguf.close()
    except GGUFError as error:
        reason = str(error).removeprefix(f"{path}: ")
        raise CreateModelError(f"{what} is not a usable GGUF model: {reason}") from None
    except OSError as error:
        raise CreateModelError(f"cannot read {what}: {error.strerror}") from None


def create_model(store: Store, name: str | ModelName, spec: ModelSpec, progress: Progress | None = None) -> Manifest:
    """Write the manifest of `name` built from `spec`, reporting Ollama's create progress dicts.

    Blocking: from Trio, run it with `trio.to_thread.run_sync`. The same spec gives the same manifest, and
    blobs already in the store are reused. Blobs only the replaced manifest of `name` used are removed.
    """
    report = progress or (lambda event: None)
    model_name = parse_name(name)
    base_layers = check_spec(store, spec)
    if spec.from_model is None:
        report({"status": "parsing GGUF"})
    layers = [(layer.media_type, layer.digest) for layer in base_layers]
    created: set[str] = set()
    if spec.gguf_blob is not None:
        layers.append((MODEL_MEDIA_TYPE, spec.gguf_blob))
    elif spec.gguf_path is not None:
        digest = _file_digest(spec.gguf_path)
        if not store.has_blob(digest):
            created.add(store.write_blob(spec.gguf_path, digest))
        layers.append((MODEL_MEDIA_TYPE, digest))
    new: dict[str, bytes] = {}  # digest -> content of the layers this create adds

    def replace(media_type: str, content: bytes | None) -> None:
        layers[:] = [layer for layer in layers if layer[0] != media_type]
        if content:
            digest = _digest(content)
            new[digest] = content
            layers.append((media_type, digest))

    if spec.template is not None:
        replace(TEMPLATE_MEDIA_TYPE, spec.template.encode())
    if spec.system is not None:
        replace(SYSTEM_MEDIA_TYPE, spec.system.encode())
    if spec.parameters is not None:
        merged = _base_parameters(store, base_layers) | spec.parameters
        replace(PARAMS_MEDIA_TYPE, json.dumps(merged, sort_keys=True).encode() if merged else None)
    if spec.messages:
        replace(MESSAGES_MEDIA_TYPE, json.dumps([m.to_json() for m in spec.messages]).encode())
    for text in spec.license:
        digest = _digest(text.encode())
        if (LICENSE_MEDIA_TYPE, digest) not in layers:
            new[digest] = text.encode()
            layers.append((LICENSE_MEDIA_TYPE, digest))

    for _, digest in layers:
        if digest not in created and not store.has_blob(digest):
            created.add(store.write_blob(new[digest], digest))
        verb = "creating new" if digest in created else "using existing"
        report({"status": f"{verb} layer {digest}"})
    replaced = store.manifest(model_name)
    report({"status": "writing manifest"})
    manifest = store.write_manifest(model_name, layers)
    if replaced is not None:
        store.prune(replaced.blobs - manifest.blobs)
    report({"status": "success"})
    return manifest


def _digest(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()


def _base_parameters(store: Store, layers: Iterable[Layer]) -> dict[str, Any]:
    layer = next((layer for layer in layers if layer.media_type == PARAMS_MEDIA_TYPE), None)
    if layer is None:
        return {}
    value = _read_json(store, layer)
    return value if isinstance(value, dict) else {}


# --- reading a model's defaults -------------------------------------------------------------------------


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

    def to_modelfile(self, from_: str) -> Modelfile:
        """The Modelfile that recreates the model from `from_` (what /api/show prints)."""
        parameters = {name: self.options[name] for name in STANDARD_OPTIONS if name in self.options}
        return Modelfile(from_, parameters, self.template, self.system, self.messages, self.license)


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
        return parse_messages(raw if isinstance(raw, list) else ())
    except CreateModelError as error:
        log.warning("model %s: ignoring its messages: %s", model, error)
        return ()


def format_parameters(options: dict[str, Any]) -> str:
    """Options as /api/show's `parameters` text: one `name value` line each, strings quoted, as Ollama does."""
    lines = []
    for name, value in options.items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            shown = json.dumps(item) if isinstance(item, str) else _format_value(item)
            lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)
