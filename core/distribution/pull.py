"""Pulling a model from an Ollama-style registry into a store.

The manifest is untrusted input: it is read up to a cap, every digest in it is validated before it
names a file, its layers must be Ollama's media types, and the blobs it declares must fit on the
store's disk. Each blob is downloaded into a resumable partial file (see `download`); only when every
blob is there and matches its digest do they move into the store, and then the manifest, byte for
byte as the registry sent it (so the model's digest is the registry's). A pull that fails leaves the
store's blobs and manifests as they were; partial files stay for the next pull to continue, except
when the disk filled: then they go too (they hold the space the user must free), with every blob
this pull had moved into the store, and the pull fails with StoreFullError.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from corral.distribution.download import MAX_PARTS, MIN_PART_SIZE, BlobDownload, exclusive_blob
from corral.distribution.errors import NotEnoughSpaceError, UntrustedContentError
from corral.distribution.oci import DOCKER_MANIFEST, OCI_MANIFEST, Registry, RegistryStatusError
from corral.errors import InvalidModelNameError, ModelNotFoundError
from corral.store import (
    OLLAMA_LAYER_MEDIA_TYPES, TEMPLATE_MEDIA_TYPE, CorruptManifestError, Layer, Manifest, ModelName, Store, StoreFullError, full_disk_error,
    is_full_disk,
)

Progress = Callable[[dict], None]

# No Ollama model has more than a handful of layers; a manifest listing thousands is hostile.
MAX_LAYERS = 256


def pull_model(
    store: Store,
    name: ModelName,
    progress: Progress | None = None,
    insecure: bool = False,
    min_part_size: int = MIN_PART_SIZE,
    workers: int = MAX_PARTS,
) -> Manifest:
    """Fetch `name` from its registry into `store`, reporting Ollama's pull progress dicts."""
    report = progress or (lambda event: None)
    repository = f"{name.namespace}/{name.model}"
    with Registry(name.host, insecure=insecure) as registry, contextlib.ExitStack() as held:
        raw = _fetch_manifest(registry, repository, name)
        # Reported once the manifest is in hand, so a name the registry lacks is one error line alone.
        report({"status": "pulling manifest"})
        blobs = _unique_blobs(parse_remote_manifest(raw, name))
        # Two pulls sharing a blob take turns with it (in digest order, so they cannot deadlock).
        for layer in sorted(blobs, key=lambda layer: layer.digest):
            if not store.has_blob(layer.digest):
                held.enter_context(exclusive_blob(store, layer.digest))
        downloads = {layer.digest: BlobDownload(store, layer, min_part_size) for layer in blobs if not store.has_blob(layer.digest)}
        _check_space(store, list(downloads.values()))
        with _undone_when_the_disk_fills(store, downloads):
            for layer in blobs:
                download = downloads.get(layer.digest)
                if download is None:
                    report(layer_progress("pulling", layer, layer.size))
                    continue
                download.run(registry, repository, lambda completed, layer=layer: report(layer_progress("pulling", layer, completed)), workers)
            report({"status": "verifying sha256 digest"})
            for download in downloads.values():
                download.verify()
            _check_templates(store, blobs, downloads)
            for download in downloads.values():
                download.commit()
            report({"status": "writing manifest"})
            replaced = _stored_manifest(store, name)
            stored = store.write_manifest_bytes(name, raw)
        if replaced is not None:
            store.prune(replaced.blobs - stored.blobs)  # as Ollama does: an updated model drops the layers only it used
    report({"status": "success"})
    return stored


@contextlib.contextmanager
def _undone_when_the_disk_fills(store: Store, downloads: dict[str, BlobDownload]) -> Iterator[None]:
    """A disk that fills inside the block (a download's write, its record, the manifest) undoes the pull:
    its partial files and the blobs it stored go, and StoreFullError says so."""
    try:
        yield
    except (OSError, StoreFullError) as error:
        if not (isinstance(error, StoreFullError) or is_full_disk(error)):
            raise
        written = sum(download.completed for download in downloads.values())
        for download in downloads.values():
            if download.committed:
                store.blob_path(download.layer.digest).unlink(missing_ok=True)  # absent before this pull (see pull_model)
            download.discard()
        raise full_disk_error(written) from None


def _check_templates(store: Store, blobs: list[Layer], downloads: dict[str, BlobDownload]) -> None:
    """A template layer must compile (Go or Jinja), as `create` requires: refused before anything enters the store."""
    from corral.template import TemplateError, compile_template

    for layer in blobs:
        if layer.media_type != TEMPLATE_MEDIA_TYPE:
            continue
        download = downloads.get(layer.digest)
        path = download.path if download is not None else store.blob_path(layer.digest)
        try:
            compile_template(path.read_bytes().decode("utf-8"))
        except (TemplateError, UnicodeDecodeError) as error:
            raise UntrustedContentError(f"the model's template cannot be used: {error}") from error


def _fetch_manifest(registry: Registry, repository: str, name: ModelName) -> bytes:
    try:
        return registry.manifest(repository, name.tag)
    except RegistryStatusError as error:
        if error.status == 404:
            raise ModelNotFoundError(f"model '{name}' not found in the registry {name.host}") from None
        raise


def parse_remote_manifest(raw: bytes, name: ModelName) -> Manifest:
    """A registry's manifest as a Manifest, refused unless it is a well-formed Ollama model manifest."""

    def refuse(reason: str) -> UntrustedContentError:
        return UntrustedContentError(f"the registry {name.host} sent an unusable manifest for '{name}': {reason}")

    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise refuse("not JSON") from None
    if not isinstance(data, dict) or data.get("schemaVersion") != 2:
        raise refuse("not a schema 2 image manifest")
    if data.get("mediaType", DOCKER_MANIFEST) not in (DOCKER_MANIFEST, OCI_MANIFEST):
        raise refuse(f"media type {str(data.get('mediaType'))[:100]!r} is not an image manifest")
    if not isinstance(data.get("layers"), list) or len(data["layers"]) > MAX_LAYERS:
        raise refuse(f"it must list between 1 and {MAX_LAYERS} layers")
    try:
        manifest = Manifest.from_bytes(raw)
    except (CorruptManifestError, InvalidModelNameError) as error:
        raise refuse(str(error)) from None
    for layer in manifest.layers:
        if layer.media_type not in OLLAMA_LAYER_MEDIA_TYPES:
            raise refuse(f"a layer of media type {layer.media_type[:100]!r} is not part of an Ollama model")
    if manifest.model is None:
        raise refuse("it has no model (GGUF) layer")
    return manifest


def layer_progress(verb: str, layer: Layer, completed: int) -> dict:
    """Ollama's per-layer progress event: `pulling <12 hex>` with digest, total and completed."""
    return {
        "status": f"{verb} {layer.digest.removeprefix('sha256:')[:12]}",
        "digest": layer.digest,
        "total": layer.size,
        "completed": completed,
    }


def _stored_manifest(store: Store, name: ModelName) -> Manifest | None:
    try:
        return store.manifest(name)
    except CorruptManifestError:
        return None  # replaced wholesale


def _unique_blobs(manifest: Manifest) -> list[Layer]:
    """The layers then the config, each digest once (Ollama's order)."""
    seen: dict[str, Layer] = {}
    for layer in manifest.layers + ((manifest.config,) if manifest.config else ()):
        if seen.setdefault(layer.digest, layer).size != layer.size:
            raise UntrustedContentError(f"the manifest declares blob {layer.digest} with two sizes")
    return list(seen.values())


def _check_space(store: Store, downloads: list[BlobDownload]) -> None:
    """Refuse before writing anything when the declared sizes cannot fit on the store's disk."""
    needed = sum(download.layer.size - download.resumed for download in downloads)
    existing = next(path for path in (store.blobs_dir, *Path(store.blobs_dir).parents) if path.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        message = (
            f"the disk holding the model store is too full for this model: it needs {needed / (1 << 20):.1f} MiB, "
            f"{free / (1 << 20):.1f} MiB are free; free some space, pull a smaller model, or set CORRAL_MODELS to a store on a larger disk"
        )
        raise NotEnoughSpaceError(message)
