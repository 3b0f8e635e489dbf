"""Fetching one blob in parallel ranged parts, resumable across pulls.

The bytes land in `blobs/sha256-<hex>-partial` (a file of the blob's declared size, each part written
at its offset) beside `blobs/sha256-<hex>-partial.json`, which records how far each part got. An
interrupted pull leaves both; the next pull of any model using the blob continues each part where
the record says it stopped. Only `BlobDownload.commit` moves the file into the store, and only after
its sha256 matches the digest. Bytes that prove wrong (a digest mismatch, more bytes than declared)
are thrown away with the partial, so a retry starts clean.

Workers write; only the thread that calls `run` reports progress and writes the record, so a
progress callback that raises (a client gone away, Ctrl-C) stops the workers and keeps what they had.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import httpx

from corral.distribution.errors import RegistryError, RegistryUnreachableError, UntrustedContentError
from corral.distribution.oci import Registry
from corral.store import Layer, Store

log = logging.getLogger(__name__)

# Ollama's shape: up to 16 parts of at least 100 MB each, so a small blob is one request.
MAX_PARTS = 16
MIN_PART_SIZE = 100_000_000
RETRIES = 3
_REPORT_EVERY = 0.2  # seconds between progress reports (and record writes)


_blob_locks: dict[tuple[str, str], threading.Lock] = {}
_blob_locks_guard = threading.Lock()


@contextlib.contextmanager
def exclusive_blob(store: Store, digest: str) -> Iterator[None]:
    """Hold a blob's partial file alone: a second pull of it in this process waits, then finds it stored."""
    key = (str(store.root.resolve()), digest)
    with _blob_locks_guard:
        lock = _blob_locks.setdefault(key, threading.Lock())
    with lock:
        yield


class DownloadInterrupted(Exception):
    """Raised inside a worker when the download is being stopped."""


@attrs.define
class Part:
    """Bytes [start, end) of the blob, of which the first `completed` are on disk."""

    start: int
    end: int
    completed: int = 0

    @property
    def position(self) -> int:
        return self.start + self.completed

    @property
    def done(self) -> bool:
        return self.position >= self.end


def plan_parts(size: int, min_part_size: int = MIN_PART_SIZE, max_parts: int = MAX_PARTS) -> list[Part]:
    """Cut `size` bytes into at most `max_parts` parts of at least `min_part_size` (one part for a small blob)."""
    count = max(1, min(max_parts, size // max(1, min_part_size)))
    step = -(-size // count) if size else 0
    return [Part(start, min(start + step, size)) for start in range(0, size, step)] if size else []


class BlobDownload:
    """One blob's partial file and record in a store; `run` fills it from a registry, `commit` stores it."""

    def __init__(self, store: Store, layer: Layer, min_part_size: int = MIN_PART_SIZE):
        self.layer = layer
        self.store = store
        stem = store.blob_path(layer.digest).name  # validated digest: sha256-<64 hex>
        self.path = store.blobs_dir / f"{stem}-partial"
        self.record_path = store.blobs_dir / f"{stem}-partial.json"
        self.parts = self._recorded_parts() or plan_parts(layer.size, min_part_size)
        self.resumed = self.completed  # bytes an earlier pull left on disk
        self.committed = False
        self._cancel = threading.Event()
        self._lock = threading.Lock()

    @property
    def completed(self) -> int:
        return sum(part.completed for part in self.parts)

    def _recorded_parts(self) -> list[Part] | None:
        """The parts of a record left by an earlier pull, when it and the file match this layer."""
        try:
            record = json.loads(self.record_path.read_text())
            parts = [Part(int(start), int(end), int(done)) for start, end, done in record["parts"]]
            matches = record["digest"] == self.layer.digest and record["size"] == self.layer.size
            on_disk = self.path.stat().st_size == self.layer.size
        except (OSError, ValueError, KeyError, TypeError):
            return None
        contiguous = all(a.end == b.start for a, b in zip(parts, parts[1:]))
        sane = all(0 <= p.completed <= p.end - p.start for p in parts) and contiguous
        if not (matches and on_disk and sane and parts and parts[0].start == 0 and parts[-1].end == self.layer.size):
            return None
        return parts

    def run(self, registry: Registry, repository: str, on_progress: Callable[[int], None], workers: int = MAX_PARTS) -> None:
        """Fetch every unfinished part, `workers` at a time, calling `on_progress(completed)` as bytes arrive."""
        self.store.blobs_dir.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size != self.layer.size:
            with open(self.path, "wb") as file:
                file.truncate(self.layer.size)  # sparse: parts fill it at their offsets
        pending = [part for part in self.parts if not part.done]
        on_progress(self.completed)
        if not pending:
            return
        self._write_record()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(pending)), thread_name_prefix="corral-pull")
        futures = [pool.submit(self._fetch_part, registry, repository, part) for part in pending]
        try:
            while True:
                finished, running = concurrent.futures.wait(futures, timeout=_REPORT_EVERY, return_when="FIRST_EXCEPTION")
                for future in finished:
                    future.result()  # raises the first worker error
                on_progress(self.completed)
                self._write_record()
                if not running:
                    return
        finally:
            self._cancel.set()
            pool.shutdown(wait=True)
            self._write_record()

    def _fetch_part(self, registry: Registry, repository: str, part: Part) -> None:
        for attempt in range(RETRIES + 1):
            try:
                self._stream_part(registry, repository, part)
                return
            except (httpx.TransportError, RegistryUnreachableError) as error:
                if attempt == RETRIES or self._cancel.is_set():
                    raise RegistryError(f"lost the connection to {registry.host} while pulling {self.layer.digest}: {error}") from None
                log.info("retrying part %d-%d of %s after: %s", part.position, part.end, self.layer.digest, error)
                time.sleep(0.5 * (attempt + 1))

    def _stream_part(self, registry: Registry, repository: str, part: Part) -> None:
        with registry.blob(repository, self.layer.digest, part.position, part.end) as response:
            self._check_response(response, part)
            with open(self.path, "r+b") as file:
                file.seek(part.position)
                # Each piece as it arrives: a buffering iterator would lose what it held when the connection drops.
                for chunk in response.iter_raw():
                    if self._cancel.is_set():
                        raise DownloadInterrupted()
                    room = part.end - part.position
                    file.write(chunk[:room])
                    with self._lock:
                        part.completed += min(room, len(chunk))
                    if len(chunk) > room:
                        if part.end == self.layer.size:
                            raise self._reject(f"the registry sent more than the {self.layer.size} bytes declared")
                        break  # a whole-blob answer to the first part: the rest belongs to other parts
                    if part.done and part.end < self.layer.size:
                        break
        if not part.done:
            raise httpx.RemoteProtocolError(f"the answer ended at byte {part.position} of {part.end}")

    def _check_response(self, response: httpx.Response, part: Part) -> None:
        """A 206 must cover the asked range of a blob of the declared size; a 200 is only usable from byte 0."""
        if response.status_code == 206:
            unit, _, spec = response.headers.get("Content-Range", "").partition(" ")
            span, _, total = spec.partition("/")
            first = span.partition("-")[0]
            if unit != "bytes" or not first.isdigit() or int(first) != part.position:
                raise RegistryError(f"the registry answered a ranged request for {self.layer.digest} with another range ({spec!r})")
            if total.isdigit() and int(total) != self.layer.size:
                raise self._reject(f"the registry holds {total} bytes, the manifest declares {self.layer.size}")
            return
        length = response.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.layer.size:
            raise self._reject(f"the registry sends {length} bytes, more than the {self.layer.size} declared")
        if part.position != 0:
            raise RegistryError(f"the registry ignored a ranged request for {self.layer.digest}; cannot resume it")

    def _reject(self, reason: str) -> UntrustedContentError:
        self.discard()
        return UntrustedContentError(f"blob {self.layer.digest} rejected: {reason}")

    def _write_record(self) -> None:
        with self._lock:
            parts = [[part.start, part.end, part.completed] for part in self.parts]
        if not self.path.exists():
            return  # discarded
        record = {"digest": self.layer.digest, "size": self.layer.size, "parts": parts}
        self._record_tmp.write_text(json.dumps(record))
        os.replace(self._record_tmp, self.record_path)

    @property
    def _record_tmp(self) -> Path:
        return self.record_path.with_name(self.record_path.name + ".tmp")

    def verify(self) -> None:
        """Check the finished file against the digest; a mismatch discards it and raises."""
        with open(self.path, "rb") as file:
            actual = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
        if actual != self.layer.digest:
            raise self._reject(f"its bytes have digest {actual}")

    def commit(self) -> None:
        """Move the verified file into the store under its digest and drop the record."""
        os.chmod(self.path, 0o644)
        os.replace(self.path, self.store.blob_path(self.layer.digest))
        self.committed = True
        self.record_path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove the partial file and its record (and a record being replaced when the disk filled)."""
        for path in (self.path, self.record_path, self._record_tmp):
            with contextlib.suppress(FileNotFoundError):
                Path(path).unlink()
