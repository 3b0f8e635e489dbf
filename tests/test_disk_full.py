"""A full disk during create, upload or pull: a clear error, and the store exactly as it was (a small tmpfs as the
disk). A pull the disk cannot hold is refused before it writes; one during which the disk fills (another program
writes, or the blob's pages and the download's record do not fit after all) takes back all it wrote, partial files too."""

import functools
import json
import os
import shutil
import subprocess

import httpx
import pytest
import trio
from click.testing import CliRunner
from conftest import _serve
from hub_server import HubServer
from registry_servers import FakeRegistry, free_port, sha256
from tiny_gguf import write_tiny_llama

from corral.cli import main
from corral.distribution.errors import NotEnoughSpaceError
from corral.errors import CorralError
from corral.modelfile import ModelSpec, create_model
from corral.store import CONFIG_MEDIA_TYPE, MODEL_MEDIA_TYPE, Store, StoreFullError


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount; skipped where that is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def snapshot(root) -> dict:
    """Every file under `root` with its size."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def test_create_on_a_full_disk_is_a_clear_error_and_leaves_the_store_unchanged(small_disk, tmp_path):
    store = Store(small_disk / "models")
    small = write_tiny_llama(tmp_path / "small.gguf")
    assert os.path.getsize(small) < 512 * 1024
    create_model(store, "small:latest", ModelSpec(gguf_path=small))
    before = snapshot(store.root)
    big = write_tiny_llama(tmp_path / "big.gguf", embedding_length=256, feed_forward_length=512)
    assert os.path.getsize(big) > 1024 * 1024
    with pytest.raises(CorralError, match="disk holding the model store is full"):
        create_model(store, "big:latest", ModelSpec(gguf_path=big))
    assert snapshot(store.root) == before
    assert store.manifest("big:latest") is None and store.manifest("small:latest") is not None


def test_an_upload_on_a_full_disk_is_a_clear_error_and_leaves_no_partial_blob(small_disk):
    store = Store(small_disk / "models")
    with pytest.raises(StoreFullError, match="disk holding the model store is full") as raised:
        store.write_blob(os.urandom(2 << 20))
    assert str(small_disk) not in str(raised.value)
    assert snapshot(store.root) == {}


# --- pulls from a registry (registry_servers.FakeRegistry, a real HTTP server) ---------------------

CONFIG = b'{"model_format":"gguf"}'


@pytest.fixture
def registry():
    fake = FakeRegistry()
    yield fake
    fake.close()


@pytest.fixture
def disk_store(small_disk, tmp_path) -> Store:
    """A store on the small disk that already holds a model, so 'unchanged' means something."""
    store = Store(small_disk / "models")
    create_model(store, "small:latest", ModelSpec(gguf_path=write_tiny_llama(tmp_path / "small.gguf")))
    return store


def publish(registry: FakeRegistry, model: bytes) -> str:
    """`model` as a GGUF layer of evil/model:latest (with a config) on the registry; its name."""
    for data in (model, CONFIG):
        registry.blobs[sha256(data)] = data
    layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": sha256(model), "size": len(model)}]
    registry.add_model("evil/model", "latest", layers, {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256(CONFIG), "size": len(CONFIG)})
    return f"{registry.host}/evil/model:latest"


def fill(disk, leave: int = 0) -> None:
    """Another program fills the disk, leaving about `leave` bytes."""
    with open(disk / "someone-elses-file", "ab", buffering=0) as file:
        while (free := shutil.disk_usage(disk).free) > leave:
            try:
                file.write(b"\0" * min(64 << 10, max(4096, free - leave)))
            except OSError:
                break


def fits_until_written(store: Store) -> bytes:
    """A model its declared size lets through the pull's free-space check, whose pages (with the config's and
    the download record's) then do not fit: the disk fills while it downloads."""
    return os.urandom(shutil.disk_usage(store.root).free - len(CONFIG) - 16)


def assert_pull_undone(store: Store, before: dict, error: BaseException) -> None:
    assert "disk holding the model store is full" in str(error) and str(store.root) not in str(error)
    assert snapshot(store.root) == before  # no blob, no manifest, no partial file or download record
    assert store.manifest("small:latest") is not None


@pytest.mark.parametrize("leave", [0, 16 << 10], ids=["the-download-record", "the-blob"])
def test_a_disk_that_fills_while_a_pull_downloads_undoes_the_pull(disk_store, small_disk, registry, leave):
    name = publish(registry, os.urandom(256 << 10))
    before = snapshot(disk_store.root)

    def another_program_fills_the_disk(event):
        if event.get("completed") == 0:  # the model's download is about to start
            fill(small_disk, leave)

    with pytest.raises(StoreFullError) as raised:
        disk_store.pull(name, progress=another_program_fills_the_disk, insecure=True)
    assert_pull_undone(disk_store, before, raised.value)


def test_a_disk_that_fills_before_the_manifest_is_written_takes_the_pulled_blobs_back(disk_store, small_disk, registry):
    name = publish(registry, os.urandom(256 << 10))
    before = snapshot(disk_store.root)

    def another_program_fills_the_disk(event):
        if event["status"] == "writing manifest":
            fill(small_disk)

    with pytest.raises(StoreFullError) as raised:
        disk_store.pull(name, progress=another_program_fills_the_disk, insecure=True)
    assert_pull_undone(disk_store, before, raised.value)


def test_a_pull_too_big_for_the_disk_is_refused_before_it_writes(disk_store, registry):
    name = publish(registry, os.urandom(2 << 20))
    before = snapshot(disk_store.root)
    with pytest.raises(NotEnoughSpaceError, match="disk holding the model store is too full for this model: it needs 2.0 MiB") as raised:
        disk_store.pull(name, insecure=True)
    assert str(disk_store.root) not in str(raised.value)
    assert snapshot(disk_store.root) == before
    assert not [path for path in registry.requests if "/blobs/" in path]


async def test_over_http_and_the_cli_a_full_disk_is_a_507_and_an_error_line(disk_store, registry, nursery, monkeypatch):
    name = publish(registry, fits_until_written(disk_store))
    before = snapshot(disk_store.root)
    server = await _serve(disk_store.root, nursery)
    async with httpx.AsyncClient(base_url=server, timeout=60) as client:
        whole = await client.post("/api/pull", json={"model": name, "insecure": True, "stream": False})
        assert whole.status_code == 507
        assert "507" in (await client.get("/openapi.json")).json()["paths"]["/api/pull"]["post"]["responses"]  # documented
        assert whole.json()["error"].startswith("the disk holding the model store is full (")
        assert "/" not in whole.json()["error"].split(";")[0] and "Traceback" not in whole.text
        assert_pull_undone(disk_store, before, whole.json()["error"])

        async with client.stream("POST", "/api/pull", json={"model": name, "insecure": True}) as streamed:
            lines = [json.loads(line) async for line in streamed.aiter_lines() if line]
        assert streamed.status_code == 200 and lines[0] == {"status": "pulling manifest"}
        assert lines[-1]["error"] == whole.json()["error"]
        assert_pull_undone(disk_store, before, lines[-1]["error"])

    monkeypatch.setenv("CORRAL_HOST", server.removeprefix("http://"))  # the CLI pulls through the server
    cli = await trio.to_thread.run_sync(functools.partial(CliRunner().invoke, main, ["pull", name, "--insecure"]))
    assert cli.exit_code == 1
    assert "the disk holding the model store is full" in cli.output and "Traceback" not in cli.output
    assert_pull_undone(disk_store, before, cli.output)

    monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{free_port()}")  # no server there: the CLI pulls into the store itself
    monkeypatch.setenv("CORRAL_MODELS", str(disk_store.root))
    alone = await trio.to_thread.run_sync(functools.partial(CliRunner().invoke, main, ["pull", name, "--insecure"]))
    assert alone.exit_code == 1 and "the disk holding the model store is full" in alone.output
    assert_pull_undone(disk_store, before, alone.output)


# --- hf.co pulls (tests/hub_server.py answers the Hub's endpoints) -----------------------------------


@pytest.fixture
def big_hub(tmp_path, monkeypatch):
    """A local Hub serving tiny/Big-GGUF, one GGUF of more than the small disk's 1 MiB; HF_ENDPOINT at it."""
    folder = tmp_path / "hub" / "tiny" / "Big-GGUF"
    folder.mkdir(parents=True)
    write_tiny_llama(folder / "Big-Q8_0.gguf", embedding_length=256, feed_forward_length=512)
    assert os.path.getsize(folder / "Big-Q8_0.gguf") > 1 << 20
    with HubServer(tmp_path / "hub") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield hub


def test_an_hf_pull_into_a_full_store_is_a_clear_error_and_leaves_it_unchanged(disk_store, big_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # another disk: the file is copied into the store
    before = snapshot(disk_store.root)
    with pytest.raises(StoreFullError) as raised:
        disk_store.pull("hf.co/tiny/Big-GGUF")
    assert_pull_undone(disk_store, before, raised.value)


@pytest.mark.filterwarnings("ignore:Not enough free disk space")  # huggingface_hub's own, before it tries
def test_an_hf_pull_whose_cache_fills_its_disk_says_so(disk_store, small_disk, big_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(small_disk / "hf-cache"))
    before = snapshot(disk_store.root)
    with pytest.raises(CorralError, match="the disk holding the Hugging Face cache .HF_HUB_CACHE. is full") as raised:
        disk_store.pull("hf.co/tiny/Big-GGUF")
    assert str(small_disk) not in str(raised.value)
    assert snapshot(disk_store.root) == before
