"""Pushing a model from a store to an Ollama-style registry.

Each blob (the layers, then the config) is checked with HEAD and skipped when the registry has it;
otherwise it is uploaded: in one PUT when it is at most `chunk_size` bytes, else in PATCH chunks of
that size closed by an empty PUT. The manifest goes last, the very bytes the store holds, so the
registry names the model by the same digest as the store does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from corral.distribution.oci import Registry
from corral.distribution.pull import layer_progress
from corral.errors import ModelNotFoundError
from corral.store import BlobNotFoundError, Layer, Manifest, ModelName, Store

Progress = Callable[[dict], None]

CHUNK_SIZE = 64 << 20  # bytes per PATCH; a blob up to this size goes in one PUT
_READ = 1 << 20


def push_model(
    store: Store, name: ModelName, progress: Progress | None = None, insecure: bool = False, chunk_size: int = CHUNK_SIZE
) -> None:
    """Upload `name` from `store` to the registry its name points at, reporting Ollama's push progress dicts."""
    report = progress or (lambda event: None)
    report({"status": "retrieving manifest"})
    try:
        raw = store.manifest_path(name).read_bytes()
    except FileNotFoundError:
        raise ModelNotFoundError(f"model '{name}' not found; create, copy or pull it under that name first") from None
    manifest = Manifest.from_bytes(raw)
    blobs = manifest.layers + ((manifest.config,) if manifest.config else ())
    for layer in blobs:
        if not store.has_blob(layer.digest):
            raise BlobNotFoundError(f"model '{name}' is missing its blob {layer.digest}; pull or create it again")
    repository = f"{name.namespace}/{name.model}"
    with Registry(name.host, insecure=insecure) as registry:
        for layer in blobs:
            report(layer_progress("pushing", layer, 0))
            if not registry.has_blob(repository, layer.digest):
                _upload(registry, repository, layer, store.blob_path(layer.digest), chunk_size, report)
            report(layer_progress("pushing", layer, layer.size))
        report({"status": "pushing manifest"})
        registry.put_manifest(repository, name.tag, raw)
    report({"status": "success"})


def _upload(registry: Registry, repository: str, layer: Layer, path: Path, chunk_size: int, report: Progress) -> None:
    url = registry.start_upload(repository)
    if layer.size <= chunk_size:

        def content() -> Iterator[bytes]:
            sent = 0
            with open(path, "rb") as file:
                while block := file.read(_READ):
                    yield block
                    sent += len(block)
                    report(layer_progress("pushing", layer, sent))

        registry.finish_upload(url, layer.digest, content, layer.size)
        return
    with open(path, "rb") as file:
        offset = 0
        while chunk := file.read(chunk_size):
            url = registry.upload_chunk(url, chunk, offset)
            offset += len(chunk)
            report(layer_progress("pushing", layer, offset))
    registry.finish_upload(url, layer.digest)
