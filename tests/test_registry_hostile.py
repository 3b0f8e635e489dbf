"""Pulling from a registry that cannot be trusted, and one that wants a token: a small registry of our
own (registry_servers.FakeRegistry, a real HTTP server) serves hostile manifests and blobs; every one
is refused with a clear error and the store left exactly as it was."""

import functools
import json
import logging
import os
import shutil

import httpx
import ollama
import pytest
import trio
from registry_servers import FakeRegistry, sha256

from corral.distribution.download import exclusive_blob
from corral.distribution.errors import NotEnoughSpaceError, RegistryAuthError, UntrustedContentError
from corral.distribution.oci import MAX_MANIFEST_BYTES
from corral.distribution.pull import pull_model
from corral.store import CONFIG_MEDIA_TYPE, MODEL_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE, Store, parse_name

GGUF = b"GGUF" + bytes(range(256)) * 64
TEMPLATE = b"{{ .Prompt }}"
CONFIG = b'{"model_format":"gguf"}'


def layer(media_type: str, data: bytes, digest: str | None = None, size: int | None = None) -> dict:
    return {"mediaType": media_type, "digest": digest or sha256(data), "size": len(data) if size is None else size}


@pytest.fixture
def fake():
    registry = FakeRegistry()
    for data in (GGUF, TEMPLATE, CONFIG):
        registry.blobs[sha256(data)] = data
    yield registry
    registry.close()


@pytest.fixture
def store(tiny_store_root, tmp_path) -> Store:
    """A store that already holds a model, so 'unchanged' means something."""
    shutil.copytree(tiny_store_root, tmp_path / "models", copy_function=os.link)
    return Store(tmp_path / "models")


def snapshot(store: Store) -> dict[str, bytes]:
    return {str(path.relative_to(store.root)): path.read_bytes() for path in sorted(store.root.rglob("*")) if path.is_file()}


def publish(fake: FakeRegistry, layers: list[dict], config: dict | None = None, tag: str = "latest") -> str:
    fake.add_model("evil/model", tag, layers, config if config is not None else layer(CONFIG_MEDIA_TYPE, CONFIG))
    return f"{fake.host}/evil/model:{tag}"


def test_a_well_formed_model_pulls_from_the_test_registry(fake, store):
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF), layer(TEMPLATE_MEDIA_TYPE, TEMPLATE)])
    manifest = store.pull(name, insecure=True)
    assert store.blob_path(manifest.model.digest).read_bytes() == GGUF
    assert store.manifest_path(name).read_bytes() == fake.manifests[("evil/model", "latest")]


HOSTILE = {
    "a layer digest that walks out of the store": (
        lambda: [layer(MODEL_MEDIA_TYPE, GGUF, digest="sha256:../../../../x")], None, "invalid digest"),
    "a config digest that walks out of the store": (
        lambda: [layer(MODEL_MEDIA_TYPE, GGUF)], {"mediaType": CONFIG_MEDIA_TYPE, "digest": "sha256:/etc/passwd", "size": 1},
        "invalid digest"),
    "a digest of another algorithm": (
        lambda: [layer(MODEL_MEDIA_TYPE, GGUF, digest="md5:" + "0" * 32)], None, "invalid digest"),
    "a negative size": (lambda: [layer(MODEL_MEDIA_TYPE, GGUF, size=-1)], None, "bad layer"),
    "a layer that is not part of an Ollama model": (
        lambda: [layer("application/vnd.docker.image.rootfs.diff.tar.gzip", GGUF)], None, "not part of an Ollama model"),
    "no model layer": (lambda: [layer(TEMPLATE_MEDIA_TYPE, TEMPLATE)], None, "no model"),
    "one blob declared with two sizes": (
        lambda: [layer(MODEL_MEDIA_TYPE, GGUF), layer(TEMPLATE_MEDIA_TYPE, GGUF, size=3)], None, "two sizes"),
}


@pytest.mark.parametrize("layers, config, says", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_manifest_is_refused_before_any_blob_is_fetched(fake, store, layers, config, says):
    name = publish(fake, layers(), config)
    before = snapshot(store)
    with pytest.raises(UntrustedContentError, match=says):
        store.pull(name, insecure=True)
    assert snapshot(store) == before
    assert not [path for path in fake.requests if "/blobs/" in path]


def test_an_oversize_declared_size_is_refused_before_anything_is_written(fake, store):
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF, size=1 << 60)])
    before = snapshot(store)
    with pytest.raises(NotEnoughSpaceError, match=r"too full for this model: it needs 1099511627776\.0 MiB, [\d.]+ MiB are free"):
        store.pull(name, insecure=True)
    assert snapshot(store) == before
    assert not [path for path in fake.requests if "/blobs/" in path]


def test_bytes_that_do_not_match_their_digest_never_enter_the_store(fake, store):
    wrong = b"GGUF" + bytes(len(GGUF) - 4)
    fake.blobs[sha256(GGUF)] = wrong  # same size, other bytes
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    before = snapshot(store)
    with pytest.raises(UntrustedContentError, match=f"blob {sha256(GGUF)} rejected: its bytes have digest {sha256(wrong)}"):
        store.pull(name, insecure=True)
    after = snapshot(store)
    assert {path: data for path, data in after.items() if "-partial" not in path} == before
    assert not [path for path in after if sha256(GGUF)[7:] in path]


def test_a_template_that_does_not_compile_is_refused_and_nothing_enters_the_store(fake, store):
    broken = b"{{ if .System }}never closed"
    fake.blobs[sha256(broken)] = broken
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF), layer(TEMPLATE_MEDIA_TYPE, broken)])
    before = snapshot(store)
    with pytest.raises(UntrustedContentError, match="template cannot be used"):
        store.pull(name, insecure=True)
    after = snapshot(store)
    assert {path: data for path, data in after.items() if "-partial" not in path} == before


def test_a_blob_longer_than_declared_is_cut_off_and_rejected(fake, store):
    fake.ignore_range = True  # the whole (too long) body comes back
    fake.blobs[sha256(GGUF)] = GGUF + b"more than the manifest says"
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    before = snapshot(store)
    with pytest.raises(UntrustedContentError, match=f"more than the {len(GGUF)} declared"):
        store.pull(name, insecure=True)
    assert snapshot(store) == before


def test_a_blob_shorter_than_declared_is_refused(fake, store):
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF, size=len(GGUF) + 10)])
    with pytest.raises(UntrustedContentError, match=f"holds {len(GGUF)} bytes, the manifest declares {len(GGUF) + 10}"):
        store.pull(name, insecure=True)
    assert not store.has_blob(sha256(GGUF)) and store.manifest(name) is None


def test_an_oversize_manifest_is_cut_off_and_refused(fake, store):
    fake.manifests[("evil/model", "big")] = b'{"layers": [' + b" " * MAX_MANIFEST_BYTES + b"]}"
    before = snapshot(store)
    with pytest.raises(UntrustedContentError, match="manifest from the registry is .* more than"):
        store.pull(f"{fake.host}/evil/model:big", insecure=True)
    assert snapshot(store) == before


@pytest.mark.parametrize("raw, says", [
    (b"not json", "not JSON"),
    (b'{"schemaVersion": 1, "layers": []}', "schema 2"),
    (b'{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}', "not an image manifest"),
])  # fmt: skip
def test_a_manifest_that_is_not_a_model_manifest_is_refused(fake, store, raw, says):
    fake.manifests[("evil/model", "odd")] = raw
    with pytest.raises(UntrustedContentError, match=says):
        store.pull(f"{fake.host}/evil/model:odd", insecure=True)


# ---- token auth -----------------------------------------------------------------------------------


def test_a_401_challenge_is_answered_with_a_token_and_the_request_retried(fake, store, caplog):
    fake.token = "s3cr3t-token-value"
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    with caplog.at_level(logging.DEBUG):
        manifest = pull_model(store, parse_name(name), insecure=True, min_part_size=len(GGUF) // 4, workers=4)
    assert store.blob_path(manifest.model.digest).read_bytes() == GGUF
    assert fake.token_requests[0] == {"service": "fake-registry", "scope": "repository:evil/model:pull"}
    assert len(fake.token_requests) == 1  # the token is reused by every part
    assert "s3cr3t-token-value" not in caplog.text


def test_blob_redirects_are_followed_without_taking_the_token_along(fake, store):
    cdn = FakeRegistry()
    try:
        cdn.blobs = dict(fake.blobs)
        fake.token, fake.redirect_blobs_to = "s3cr3t-token-value", f"http://{cdn.host}"
        name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
        manifest = store.pull(name, insecure=True)
        assert store.blob_path(manifest.model.digest).read_bytes() == GGUF
        assert fake.authorizations and all(header == "Bearer s3cr3t-token-value" for header in fake.authorizations)
        assert len(cdn.authorizations) == 2 and not any(cdn.authorizations)  # the GGUF and the config, no token
    finally:
        cdn.close()


def test_a_refused_token_is_a_clear_auth_error_and_keeps_nothing(fake, store):
    fake.token, fake.token_status = "never-given", 403
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    before = snapshot(store)
    with pytest.raises(RegistryAuthError, match="refused a token for repository:evil/model:pull"):
        store.pull(name, insecure=True)
    assert snapshot(store) == before


# ---- over HTTP ------------------------------------------------------------------------------------


async def in_thread(function, *args, **kwargs):
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs))


async def test_api_pull_of_a_hostile_manifest_is_502_with_the_reason(fake, tiny_server):
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF, digest="sha256:../../x")])
    client = ollama.Client(host=tiny_server)
    with pytest.raises(ollama.ResponseError) as raised:
        await in_thread(client.pull, name, insecure=True)
    assert raised.value.status_code == 502 and "invalid digest" in raised.value.error


async def test_api_pull_streams_the_error_of_a_bad_blob_as_its_last_line(fake, tiny_server):
    fake.blobs[sha256(GGUF)] = bytes(len(GGUF))
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    client = ollama.Client(host=tiny_server)
    events = []

    def drain() -> None:
        for event in client.pull(name, insecure=True, stream=True):
            events.append(event)

    with pytest.raises(ollama.ResponseError, match="rejected: its bytes have digest"):
        await in_thread(drain)
    assert any(event.digest == sha256(GGUF) for event in events)


async def test_a_client_gone_mid_pull_leaves_a_partial_that_the_next_pull_continues(fake, tiny_server, tmp_path):
    store = Store(tmp_path / "models")  # the server's store
    name = publish(fake, [layer(MODEL_MEDIA_TYPE, GGUF)])
    fake.stall_at = len(GGUF) // 2
    async with httpx.AsyncClient(base_url=tiny_server, timeout=30) as http:
        async with http.stream("POST", "/api/pull", json={"model": name, "insecure": True}) as response:
            async for line in response.aiter_lines():
                event = json.loads(line)
                if event.get("digest") == sha256(GGUF) and event["completed"] == len(GGUF) // 2:
                    break  # and hang up
    fake.release.set()

    def wait_for_the_first_pull() -> None:
        with exclusive_blob(store, sha256(GGUF)):
            pass

    await trio.to_thread.run_sync(wait_for_the_first_pull)
    record = json.loads((store.blobs_dir / f"sha256-{sha256(GGUF)[7:]}-partial.json").read_text())
    assert record["parts"] == [[0, len(GGUF), len(GGUF) // 2]] and store.manifest(name) is None
    fake.stall_at, fake.ranges = None, []
    final = await in_thread(ollama.Client(host=tiny_server).pull, name, insecure=True)
    assert final.status == "success"
    assert fake.ranges == [f"bytes={len(GGUF) // 2}-{len(GGUF) - 1}", "bytes=0-22"]
    assert store.blob_path(sha256(GGUF)).read_bytes() == GGUF
