"""Creating a model: the layers a Modelfile (or a create request) puts over its base, written to the store.

A created model is its base's layers with some replaced: `template`, `system` (text), `params` (a JSON
object of option -> value, merged key by key over the base's), `messages` (a JSON list of
{role, content}) and `license` (one text per layer, added to the base's). `defaults.model_defaults`
reads them back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from corral.errors import CorralError, GGUFError, MissingTensorError, ModelNotFoundError, UnknownArchitectureError, UnsupportedTensorTypeError
from corral.gguf import GGUFFile
from corral.modelfile.defaults import stored_parameters
from corral.modelfile.syntax import IGNORED_PARAMETERS, Message, Modelfile, ModelfileError
from corral.options import STANDARD_OPTIONS, InvalidOptionError, parse_options
from corral.registry import Plugins
from corral.store import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    MODEL_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    PROJECTOR_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    Layer,
    Manifest,
    ModelName,
    Store,
    parse_digest,
    parse_name,
)
from corral.template import TemplateError, compile_template

log = logging.getLogger(__name__)


class CreateModelError(CorralError):
    """A model cannot be created from what was given: an unusable GGUF, a bad message, a missing part."""


@attrs.frozen
class ModelSpec:
    """What `create_model` builds: one base (a model in the store, an uploaded GGUF blob, a GGUF file or a
    Hugging Face safetensors folder on this machine) and the layers that replace the base's; None keeps
    the base's layer, "" removes it."""

    from_model: str | None = None
    gguf_blob: str | None = None
    gguf_path: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    hf_folder: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))  # converted to GGUF
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None  # JSON-ready, as `validate_parameters` returns them
    messages: tuple[Message, ...] = ()  # empty: keep the base's
    license: tuple[str, ...] = ()  # added to the base's
    quantize: str | None = None  # a preset name (q4_K_M, q8_0, ...): the base's weights quantized to it
    projector_path: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))  # a vision projector GGUF

    def __attrs_post_init__(self) -> None:
        given = [v for v in (self.from_model, self.gguf_blob, self.gguf_path, self.hf_folder) if v is not None]
        if len(given) != 1:
            raise CreateModelError("give exactly one base: `from` (a model name) or `files` (an uploaded GGUF)")

    @classmethod
    def from_modelfile(cls, modelfile: Modelfile, directory: str | os.PathLike | None = None) -> ModelSpec:
        """What to create: FROM is a GGUF file or a safetensors folder (relative to `directory`) when it names one, else a model."""
        source = _resolve_from(modelfile.from_, directory)
        if isinstance(source, Path):
            base = {"hf_folder": source} if source.is_dir() else {"gguf_path": source}
        else:
            base = {"from_model": source}
        projector = None
        if modelfile.projector is not None:
            projector = _resolve_from(modelfile.projector, directory)
            if not isinstance(projector, Path) or not projector.is_file():
                raise ModelfileError(f"FROM {modelfile.projector}: a second FROM names a vision projector GGUF file, and there is no such file")
        return cls(
            **base,
            projector_path=projector,
            template=modelfile.template,
            system=modelfile.system,
            parameters=dict(modelfile.parameters) if modelfile.parameters else None,
            messages=modelfile.messages,
            license=modelfile.license,
        )


def _resolve_from(value: str, directory: str | os.PathLike | None) -> str | Path:
    """A FROM argument as a GGUF file or model folder (absolute) or a model name."""
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
    if path.is_dir() or path.is_file():
        return path.resolve()
    if looks_like_path:
        raise ModelfileError(f"FROM {value}: no such file {path}")
    return value


Progress = Callable[[dict], None]


def check_spec(store: Store, spec: ModelSpec) -> tuple[Layer, ...]:
    """Validate a spec without writing anything; returns the base model's layers (empty for a GGUF)."""
    if spec.template:
        _check_template(spec.template)
    if spec.projector_path is not None:
        _check_projector(spec.projector_path)
    if spec.from_model is not None:
        base = parse_name(spec.from_model)
        manifest = store.manifest(base)
        if manifest is None or manifest.model is None:
            raise ModelNotFoundError(f"model '{base}' not found; pull or create it first")
        if not store.has_blob(manifest.model.digest):
            raise ModelNotFoundError(f"model '{base}' is missing its GGUF blob; pull it again")
        _check_quantize(store.blob_path(manifest.model.digest), spec.quantize)
        return manifest.layers
    if spec.gguf_blob is not None:
        digest = parse_digest(spec.gguf_blob)
        if not store.has_blob(digest):
            raise CreateModelError(f"blob {digest} is not in the store; upload it with POST /api/blobs/{digest}")
        _check_gguf(store.blob_path(digest), f"the uploaded file {digest}")
        _check_quantize(store.blob_path(digest), spec.quantize)
    elif spec.hf_folder is not None:
        from corral.convert import ConvertError, HFFolder, check_folder, check_projector  # torch: only a server that converts imports it

        try:
            check_folder(spec.hf_folder)
            if spec.projector_path is None:  # a second FROM replaces the folder's own vision tower
                check_projector(HFFolder.open(spec.hf_folder))
        except ConvertError as error:
            raise CreateModelError(str(error)) from None
        if spec.quantize is not None:
            from corral.quantize import preset  # numpy and gguf: only a create that quantizes imports them

            preset(spec.quantize)  # the name now; the converted file is checked once it exists
    else:
        _check_gguf(spec.gguf_path, str(spec.gguf_path))
        _check_quantize(spec.gguf_path, spec.quantize)
    return ()


def _check_template(source: str) -> None:
    """A TEMPLATE must compile (Jinja, or Go as Ollama parses it): refused at create, never at the first chat."""
    try:
        compile_template(source)
    except TemplateError as error:
        raise CreateModelError(f"TEMPLATE: {error}") from None


def _check_quantize(path: Path, quantize: str | None) -> None:
    if quantize is not None:
        from corral.quantize import check_quantizable  # numpy and gguf: only a create that quantizes imports them

        check_quantizable(path, quantize)


def _check_projector(path: Path) -> None:
    """A second FROM must be a vision projector an installed encoder plugin reads (llama.cpp's `clip` file)."""
    try:
        gguf = GGUFFile.open(path)
    except GGUFError as error:
        raise CreateModelError(f"{path.name} is not a usable GGUF projector: {str(error).removeprefix(f'{path}: ')}") from None
    except OSError as error:
        raise CreateModelError(f"cannot read {path.name}: {error.strerror}") from None
    try:
        Plugins().vision_encoder_for(gguf)
    except UnknownArchitectureError as error:
        raise CreateModelError(f"the second FROM must be a vision projector (mmproj) GGUF: {str(error).removeprefix(f'{path}: ')}") from None
    finally:
        gguf.close()


def _check_gguf(path: Path, what: str) -> None:
    """The file must bind to an installed architecture (metadata, tensor names, shapes; no weight is read):
    a model that could never load is refused here, not answered with an error by every later request."""
    try:
        gguf = GGUFFile.open(path)
        try:
            if gguf.architecture == "clip":
                raise CreateModelError(f"{what} is a vision projector, not a model: give the model first and the projector as a second FROM")
            from corral.model import check_binds  # numpy, as the architecture plugins it binds: a create from a GGUF imports them

            check_binds(Plugins().architecture_for(gguf), gguf)
            _check_tokenizer(gguf.metadata)
        finally:
            gguf.close()
    except (GGUFError, UnknownArchitectureError, MissingTensorError, UnsupportedTensorTypeError) as error:
        reason = str(error).removeprefix(f"{path}: ")
        raise CreateModelError(f"{what} is not a usable GGUF model: {reason}") from None
    except OSError as error:
        raise CreateModelError(f"cannot read {what}: {error.strerror}") from None


def _check_tokenizer(metadata: dict) -> None:
    """The tokenizer must build from the file's metadata, as loading builds it (about a second for 262k tokens)."""
    from corral.tokenizer import Tokenizer  # tokenizers (a native library) enters the server with its first create

    try:
        Tokenizer.from_gguf(metadata)
    except CorralError as error:
        raise GGUFError(f"the tokenizer cannot be built: {error}") from None
    except (KeyError, TypeError, ValueError, IndexError) as error:  # malformed tokenizer.* values
        raise GGUFError(f"the tokenizer metadata is unusable ({type(error).__name__}: {error})") from None


def create_model(store: Store, name: str | ModelName, spec: ModelSpec, progress: Progress | None = None) -> Manifest:
    """Write the manifest of `name` built from `spec`, reporting Ollama's create progress dicts.

    Blocking: from Trio, run it with `trio.to_thread.run_sync`. The same spec gives the same manifest, and
    blobs already in the store are reused. Blobs only the replaced manifest of `name` used are removed.
    """
    report = progress or (lambda event: None)
    model_name = parse_name(name)
    base_layers = check_spec(store, spec)
    if spec.hf_folder is not None:
        report({"status": "converting model"})
    elif spec.from_model is None:
        report({"status": "parsing GGUF"})
    layers = [(layer.media_type, layer.digest) for layer in base_layers]
    created: set[str] = set()
    if spec.hf_folder is not None:
        with tempfile.TemporaryDirectory(prefix="corral-convert-") as scratch:
            converted = _converted(spec.hf_folder, Path(scratch))
            # A vision model's tower and projector become its projector layer (unless a second FROM gives one),
            # converted before anything enters the store; kept at the folder's precision, as llama.cpp's `--mmproj`
            # writes it: QUANTIZE is for the text model.
            projector = _converted_projector(spec.hf_folder, Path(scratch)) if spec.projector_path is None else None
            if spec.quantize is not None:  # quantized from the scratch file: no float copy enters the store
                _quantize_base(store, attrs.evolve(spec, hf_folder=None, gguf_path=converted), layers, created, report)
            else:
                layers.append((MODEL_MEDIA_TYPE, _stored_file(store, converted, created)))
            if projector is not None:
                layers.append((PROJECTOR_MEDIA_TYPE, _stored_file(store, projector, created)))
    elif spec.quantize is not None:
        _quantize_base(store, spec, layers, created, report)
    elif spec.gguf_blob is not None:
        layers.append((MODEL_MEDIA_TYPE, spec.gguf_blob))
    elif spec.gguf_path is not None:
        layers.append((MODEL_MEDIA_TYPE, _stored_file(store, spec.gguf_path, created)))
    if spec.projector_path is not None:
        layers[:] = [layer for layer in layers if layer[0] != PROJECTOR_MEDIA_TYPE]
        layers.append((PROJECTOR_MEDIA_TYPE, _stored_file(store, spec.projector_path, created)))
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
        merged = stored_parameters(store, base_layers) | spec.parameters
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


def _quantize_base(store: Store, spec: ModelSpec, layers: list[tuple[str, str]], created: set[str], report: Progress) -> None:
    """Quantize the base's GGUF into a new blob, which takes the place of the base's model layer."""
    from corral.quantize import check_quantizable, quantize_to_blob  # numpy and gguf: only a create that quantizes imports them

    base = next((digest for media_type, digest in layers if media_type == MODEL_MEDIA_TYPE), None)
    if base is not None:
        source = store.blob_path(base)
    else:
        source = store.blob_path(spec.gguf_blob) if spec.gguf_blob is not None else spec.gguf_path
    digest, new = quantize_to_blob(store, source, check_quantizable(source, spec.quantize), report)
    if new:
        created.add(digest)
    if base is None:
        layers.append((MODEL_MEDIA_TYPE, digest))
    else:
        layers[:] = [(media_type, digest if media_type == MODEL_MEDIA_TYPE else d) for media_type, d in layers]


def _converted(folder: Path, scratch: Path) -> Path:
    """A safetensors folder converted to a GGUF file in `scratch` (so a failure leaves the store as it was)."""
    from corral.convert import ConvertError, convert_folder  # torch: only a server that converts imports it

    try:
        return convert_folder(folder, scratch / "model.gguf")
    except ConvertError as error:
        raise CreateModelError(str(error)) from None


def _converted_projector(folder: Path, scratch: Path) -> Path | None:
    """A vision model folder's tower and projector converted to a projector GGUF in `scratch`; None for a text model."""
    from corral.convert import ConvertError, convert_projector

    try:
        return convert_projector(folder, scratch / "mmproj.gguf")
    except ConvertError as error:
        raise CreateModelError(str(error)) from None


def _stored_file(store: Store, path: Path, created: set[str]) -> str:
    """The digest of a GGUF file, written into the store unless it is there already."""
    digest = _file_digest(path)
    if not store.has_blob(digest):
        created.add(store.write_blob(path, digest))
    return digest


def _digest(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()


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
        try:
            messages.append(Message.from_json(item))
        except ValueError as error:
            raise CreateModelError(f"messages[{index}]: {error}") from None
    return tuple(messages)
