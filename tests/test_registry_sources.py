"""Which source a name pulls from, how a blob is cut into parts, and partial files an earlier pull left."""

import json
import os
import shutil

import pytest
from registry_servers import FakeRegistry, sha256

from corral.distribution.download import MIN_PART_SIZE, plan_parts
from corral.store import CONFIG_MEDIA_TYPE, MODEL_MEDIA_TYPE, Store, names_host, parse_name, pull_source

GGUF = b"GGUF" + bytes(range(256)) * 40


@pytest.mark.parametrize("name, source", [
    ("smollm2", "packaged"),
    ("smollm2:135m", "packaged"),
    ("library/gemma3:270m", "packaged"),
    ("qwen3", "registry"),
    ("me/smollm2", "registry"),
    ("registry.ollama.ai/library/smollm2", "registry"),  # a host spelled out means that registry
    ("127.0.0.1:5000/me/tiny:v1", "registry"),
])  # fmt: skip
def test_packaged_names_pull_from_pypi_and_every_other_from_a_registry(name, source):
    assert pull_source(name) == source


def test_a_host_with_a_port_parses_into_the_store_path_ollama_uses():
    name = parse_name("127.0.0.1:5000/Me/Tiny:V1")
    assert name.parts == ("127.0.0.1:5000", "me", "tiny", "v1") and names_host("127.0.0.1:5000/me/tiny")
    assert not names_host("me/tiny") and not names_host(parse_name("me/tiny"))


@pytest.mark.parametrize("size, min_part, parts", [
    (0, MIN_PART_SIZE, []),
    (10, MIN_PART_SIZE, [(0, 10)]),
    (3 * MIN_PART_SIZE - 1, MIN_PART_SIZE, [(0, 150_000_000), (150_000_000, 299_999_999)]),
    (100 * MIN_PART_SIZE, MIN_PART_SIZE, [(i * 625_000_000, (i + 1) * 625_000_000) for i in range(16)]),
    (10, 3, [(0, 4), (4, 8), (8, 10)]),
])  # fmt: skip
def test_a_blob_is_cut_into_at_most_16_parts_of_at_least_the_minimum(size, min_part, parts):
    assert [(part.start, part.end) for part in plan_parts(size, min_part)] == parts


@pytest.fixture
def fake():
    registry = FakeRegistry()
    registry.blobs[sha256(GGUF)] = GGUF
    config = b"{}"
    registry.blobs[sha256(config)] = config
    layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": sha256(GGUF), "size": len(GGUF)}]
    registry.add_model("me/tiny", "latest", layers, {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256(config), "size": len(config)})
    yield registry
    registry.close()


@pytest.mark.parametrize("record", [
    {"digest": "sha256:" + "0" * 64, "size": 1, "parts": [[0, 1, 1]]},  # another blob's
    {"parts": [[0, 10, 10**9]]},                                          # nonsense
    "not json",
])  # fmt: skip
def test_a_stale_or_foreign_partial_record_is_ignored(fake, tmp_path, record):
    store = Store(tmp_path / "models")
    stem = store.blob_path(sha256(GGUF)).name
    store.blobs_dir.mkdir(parents=True)
    (store.blobs_dir / f"{stem}-partial").write_bytes(b"\xff" * len(GGUF))
    (store.blobs_dir / f"{stem}-partial.json").write_text(record if isinstance(record, str) else json.dumps(record))
    manifest = store.pull(f"{fake.host}/me/tiny", insecure=True)
    assert store.blob_path(manifest.model.digest).read_bytes() == GGUF
    assert not list(store.blobs_dir.glob("*-partial*"))


def test_a_blob_already_in_the_store_is_not_fetched_again(fake, tmp_path, tiny_store_root):
    shutil.copytree(tiny_store_root, tmp_path / "models", copy_function=os.link)
    store = Store(tmp_path / "models")
    store.write_blob(GGUF)
    events = []
    store.pull(f"{fake.host}/me/tiny", events.append, insecure=True)
    assert f"/v2/me/tiny/blobs/{sha256(GGUF)}" not in fake.requests
    assert {"status": f"pulling {sha256(GGUF)[7:19]}", "digest": sha256(GGUF), "total": len(GGUF), "completed": len(GGUF)} in events
