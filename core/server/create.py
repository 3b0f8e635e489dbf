"""Ollama's model creation endpoints: /api/create and the blob uploads it builds on (/api/blobs/<digest>).

A client uploads a GGUF with `POST /api/blobs/sha256:<hex>`, then creates a model from it with
`POST /api/create {"model", "files": {"model.gguf": "sha256:<hex>"}}`; or it derives a model from one in
the store with `{"model", "from", "system", "parameters", ...}`; `quantize` (q4_K_M, q8_0, ...) quantizes
the base's weights. Everything a create request names is checked before anything is written. Once the
GGUF is uploaded, creating writes only a few small blobs, so the progress objects are sent when it is
done and every error gets its own status code; quantizing takes seconds, so its progress is streamed
live once the same checks have passed.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, AsyncIterator

import attrs
import quart
import trio

from corral.errors import GGUFError
from corral.gguf import GGUFFile
from corral.modelfile.create import CreateModelError, ModelSpec, check_spec, create_model, parse_messages, validate_parameters
from corral.modelfile.syntax import Modelfile
from corral.server.http import ApiError, field, ndjson_response, read_json
from corral.server.state import state
from corral.store import Store, parse_digest, parse_name

bp = quart.Blueprint("create", __name__)

# Upload bytes are handed to a worker thread in pieces of about this size.
_WRITE_SIZE = 1 << 20


@bp.post("/api/create")
async def create():
    body = await read_json()
    name = field(body, "model", str, None) or field(body, "name", str, required=True)
    stream = field(body, "stream", bool, True)
    parse_name(name)
    store = state().store
    spec, events = await trio.to_thread.run_sync(_spec_from_body, body)
    if spec.quantize is not None and stream:
        # Quantizing takes seconds, so its progress is streamed as it is made, once every check
        # create_model makes before writing has passed here (a mistake still gets its own status code).
        await trio.to_thread.run_sync(check_spec, store, spec)
        live = _live(events, state().nursery, store, name, spec)
        return ndjson_response(live, lambda error: {"error": error.message})
    # create_model checks everything before it writes, and its progress is sent only once it is done,
    # so every mistake is answered with its own status code instead of an error line after a 200.
    await trio.to_thread.run_sync(functools.partial(create_model, store, name, spec, progress=events.append))
    if not stream:
        return events[-1]
    return ndjson_response(_replay(events), lambda error: {"error": error.message})


async def _replay(events: list[dict]) -> AsyncIterator[dict]:
    for event in events:
        yield event


async def _live(events: list[dict], nursery: trio.Nursery, store: Store, name: str, spec: ModelSpec) -> AsyncIterator[dict]:
    """The progress already made, then create_model's as it reports it from its worker thread."""
    for event in events:
        yield event
    send, receive = trio.open_memory_channel(0)
    # The create runs in the server's nursery (as a pull does); this response only reads its progress.
    nursery.start_soon(_create_then_close, store, name, spec, send)
    async with receive:
        async for event in receive:
            if isinstance(event, BaseException):
                raise event
            yield event


async def _create_then_close(store: Store, name: str, spec: ModelSpec, send: trio.MemorySendChannel) -> None:
    def report(event: dict) -> None:
        trio.from_thread.run(send.send, event)  # a client gone away raises here and stops the create

    async with send:
        try:
            await trio.to_thread.run_sync(functools.partial(create_model, store, name, spec, progress=report))
        except trio.BrokenResourceError:
            pass  # nothing was written: the quantized file is removed and no manifest names it
        except Exception as exc:  # noqa: BLE001 - delivered to the streaming client
            with contextlib.suppress(trio.BrokenResourceError):
                await send.send(exc)


def _spec_from_body(body: dict) -> tuple[ModelSpec, list[dict]]:
    """The request as a ModelSpec, and the progress already made (parsing a legacy Modelfile)."""
    if field(body, "adapters", dict, {}):
        raise ApiError(400, "adapters are not supported: merge the LoRA adapter into the GGUF first")
    events: list[dict] = []
    fields: dict[str, Any] = {}
    text = field(body, "modelfile", str, None)
    if text is not None:
        # Legacy: a Modelfile whose FROM is a model name or a GGUF path on this machine; relative paths
        # are taken from the directory of `path`, the Modelfile's own location, when the client sends it.
        events.append({"status": "parsing modelfile"})
        location = field(body, "path", str, None)
        directory = Path(location).expanduser().parent if location else None
        fields = attrs.asdict(ModelSpec.from_modelfile(Modelfile.parse(text), directory), recurse=False)
    from_model = field(body, "from", str, None)
    files = field(body, "files", dict, None)
    files, projector = _split_projector(files) if files else (files, None)
    if projector is not None:
        fields["projector_path"] = state().store.blob_path(projector)
    if from_model and files:
        raise ApiError(400, "give either `from` (a model name) or `files` (uploaded GGUF blobs), not both")
    if from_model or files:
        fields.update(from_model=from_model, gguf_blob=_gguf_digest(files) if files else None, gguf_path=None, hf_folder=None)
    elif not fields:
        raise ApiError(400, "give `from` (a model name) or `files` (an uploaded GGUF: {name: digest})")
    for key in ("template", "system"):
        if (value := field(body, key, str, None)) is not None:
            fields[key] = value
    if (parameters := field(body, "parameters", dict, None)) is not None:
        fields["parameters"] = validate_parameters(parameters)
    if messages := field(body, "messages", list, None):
        fields["messages"] = parse_messages(messages)
    if (license := field(body, "license", (str, list), None)) is not None:
        fields["license"] = _licenses(license)
    # `quantization` is the field's older name, which Ollama still reads.
    if quantize := field(body, "quantize", str, "") or field(body, "quantization", str, ""):
        from corral.quantize import preset  # numpy and gguf: only a create that quantizes imports them

        fields["quantize"] = preset(quantize).name  # an unknown type: 400 listing the known ones
    return ModelSpec(**fields), events


def _split_projector(files: dict) -> tuple[dict, str | None]:
    """The uploaded files without the vision projector among them (a `clip` GGUF, as Ollama tells it by its
    content), and the projector's digest; 400 for two projectors."""
    if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in files.items()):
        raise ApiError(400, "files must map file names to blob digests (sha256:<hex>)")
    store = state().store
    projectors = []
    for name, digest in files.items():
        path = store.blob_path(parse_digest(digest))
        if name.lower().endswith(".gguf") and path.is_file() and _is_projector(path):
            projectors.append(name)
    if len(projectors) > 1:
        raise ApiError(400, f"one vision projector per model; got {', '.join(sorted(projectors))}")
    if not projectors:
        return files, None
    return {name: digest for name, digest in files.items() if name != projectors[0]}, parse_digest(files[projectors[0]])


def _is_projector(path: Path) -> bool:
    try:
        gguf = GGUFFile.open(path)
    except (GGUFError, OSError):
        return False  # the model check reports it
    try:
        return gguf.get("general.architecture") == "clip"
    finally:
        gguf.close()


def _gguf_digest(files: dict) -> str:
    """The digest of the one GGUF among the uploaded files."""
    if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in files.items()):
        raise ApiError(400, "files must map file names to blob digests (sha256:<hex>)")
    ggufs = [name for name in files if name.lower().endswith(".gguf")] or list(files)[:1]
    others = sorted(set(files) - set(ggufs))
    if len(ggufs) != 1 or others:
        raise CreateModelError(
            f"corral creates a model from one GGUF file; got {', '.join(sorted(files))}"
            " (uploaded safetensors are not converted: name their folder in a Modelfile, FROM ./dir;"
            " split GGUFs are not supported)"
        )
    return parse_digest(files[ggufs[0]])


def _licenses(value: str | list) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not all(isinstance(text, str) for text in texts):
        raise ApiError(400, "license must be a string or a list of strings")
    return tuple(text for text in texts if text)


def _blob_digest(digest: str) -> str:
    """The URL's digest, validated before it names any path; Ollama also accepts `sha256-<hex>`."""
    if digest.startswith("sha256-"):
        digest = "sha256:" + digest.removeprefix("sha256-")
    return parse_digest(digest)


@bp.route("/api/blobs/<digest>", methods=["HEAD"])
async def blob_exists(digest: str):
    present = state().store.has_blob(_blob_digest(digest))
    return "", 200 if present else 404


@bp.post("/api/blobs/<digest>")
async def upload_blob(digest: str):
    digest = _blob_digest(digest)
    store = state().store
    if store.has_blob(digest):
        # Read the body anyway: a client still sending it would see its connection cut.
        async for _ in quart.request.body:
            pass
        return "", 200
    with store.blob_writer() as writer:
        pending, size = [], 0
        async for chunk in quart.request.body:
            pending.append(chunk)
            size += len(chunk)
            if size >= _WRITE_SIZE:
                await trio.to_thread.run_sync(writer.write, b"".join(pending))
                pending, size = [], 0
        await trio.to_thread.run_sync(writer.write, b"".join(pending))
        await trio.to_thread.run_sync(writer.commit, digest)  # DigestMismatchError: 400, nothing kept
    return "", 201
