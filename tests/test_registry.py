"""Push to and pull from a real OCI registry (Debian's docker-registry, started by the session), in-process,
through the CLI, and over HTTP with the official ollama client: byte-identical round trips, parallel
ranged parts, resuming an interrupted pull, and a corrupted blob rejected with the store unchanged."""

import functools
import json
import os
import shutil
import socket
import threading
import uuid
from pathlib import Path

import ollama
import pytest
import trio
from click.testing import CliRunner
from conftest import CHATML, TINY_LLAMA
from registry_servers import CuttingProxy, docker_registry

import corral
from corral.cli import main
from corral.distribution import oci
from corral.distribution.errors import RegistryError, UntrustedContentError
from corral.distribution.pull import pull_model
from corral.distribution.push import push_model
from corral.errors import ModelNotFoundError
from corral.modelfile import ModelSpec, create_model
from corral.modelfile.defaults import model_defaults
from corral.store import Store, parse_name

pytestmark = pytest.mark.slow  # a docker-registry process: out of the fast subset (-m "not slow")


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry; .ci/run installs it)")
    with docker_registry(tmp_path_factory.mktemp("docker-registry")) as running:
        yield running


@pytest.fixture
def source(tiny_store_root, tmp_path) -> Store:
    """A private copy of the tiny store (tiny-llama with a ChatML template) to push from."""
    root = tmp_path / "source"
    shutil.copytree(tiny_store_root, root, copy_function=os.link)
    return Store(root)


@pytest.fixture
def name(registry) -> str:
    """A repository of its own for each test: the registry is shared by the session."""
    return f"{registry.host}/tests/m{uuid.uuid4().hex[:10]}:v1"


@pytest.fixture
def proxy(registry):
    running = CuttingProxy(registry.host)
    yield running
    running.close()


def files_of(store: Store, partials: bool = True) -> dict[str, bytes]:
    """Every file in a store, by relative path (resumable partials left out unless asked for)."""
    if not store.root.exists():
        return {}
    return {
        str(path.relative_to(store.root)): path.read_bytes()
        for path in sorted(store.root.rglob("*"))
        if path.is_file() and (partials or "-partial" not in path.name)
    }


def blob_files(store: Store, manifest) -> dict[str, bytes]:
    return {digest: store.blob_path(digest).read_bytes() for digest in manifest.blobs}


def renamed(source: Store, name: str) -> None:
    source.copy(TINY_LLAMA, name)


def test_push_then_pull_into_an_empty_store_is_byte_identical(registry, source, name, tmp_path):
    renamed(source, name)
    pushed = []
    source.push(name, pushed.append, insecure=True)
    target = Store(tmp_path / "target")
    pulled = []
    manifest = target.pull(name, pulled.append, insecure=True)

    assert target.manifest_path(name).read_bytes() == source.manifest_path(name).read_bytes()
    assert blob_files(target, manifest) == blob_files(source, manifest)
    assert not [path for path in target.blobs_dir.iterdir() if "-partial" in path.name]
    assert [event["status"] for event in pushed][-2:] == ["pushing manifest", "success"]
    statuses = [event["status"] for event in pulled]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    last = {event["digest"]: event for event in pulled if "digest" in event}
    assert set(last) == manifest.blobs
    assert all(event["completed"] == event["total"] and event["status"] == f"pulling {digest[7:19]}" for digest, event in last.items())


def test_pulled_model_answers_like_the_pushed_one(registry, source, name, tmp_path):
    renamed(source, name)
    source.push(name, insecure=True)
    target = Store(tmp_path / "target")
    target.pull(name, insecure=True)
    assert model_defaults(target, name).template == CHATML

    def answer(store: Store) -> str:
        return "".join(corral.load_model(store.model_path(name)).generate("Hello", max_tokens=6, temperature=0))

    text = answer(target)
    assert text and text == answer(source)


def test_push_skips_blobs_the_registry_already_has(registry, source, name, monkeypatch):
    renamed(source, name)
    source.push(name, insecure=True)
    uploads = []
    real_start = oci.Registry.start_upload
    monkeypatch.setattr(oci.Registry, "start_upload", lambda self, repo: uploads.append(repo) or real_start(self, repo))
    again = name.replace(":v1", ":v2")
    source.copy(name, again)
    source.push(again, insecure=True)
    assert uploads == []
    assert Store(source.root.parent / "other").pull(again, insecure=True).digest == source.manifest(name).digest


def test_a_blob_larger_than_the_chunk_size_is_uploaded_in_chunks(registry, source, name, tmp_path, monkeypatch):
    renamed(source, name)
    chunks = []
    real_chunk = oci.Registry.upload_chunk
    spy = lambda self, url, chunk, start: chunks.append(start) or real_chunk(self, url, chunk, start)  # noqa: E731
    monkeypatch.setattr(oci.Registry, "upload_chunk", spy)
    gguf_size = source.manifest(name).model.size
    push_model(source, parse_name(name), insecure=True, chunk_size=16 << 10)
    assert chunks == list(range(0, gguf_size, 16 << 10))
    target = Store(tmp_path / "target")
    manifest = target.pull(name, insecure=True)
    assert blob_files(target, manifest) == blob_files(source, manifest)


def test_a_large_blob_is_fetched_in_parallel_ranged_parts(registry, proxy, source, name, tmp_path):
    renamed(source, name)
    source.push(name, insecure=True)
    model = source.manifest(name).model
    through_proxy = parse_name(name.replace(registry.host, proxy.host))
    target = Store(tmp_path / "target")
    manifest = pull_model(target, through_proxy, insecure=True, min_part_size=model.size // 4, workers=4)
    ranges = sorted((r for digest, r in proxy.ranges if digest == model.digest), key=lambda r: int(r[6:].split("-")[0]))
    step = -(-model.size // 4)
    assert ranges == [f"bytes={start}-{min(start + step, model.size) - 1}" for start in range(0, model.size, step)]
    assert target.blob_path(model.digest).read_bytes() == source.blob_path(model.digest).read_bytes()
    assert manifest.digest == source.manifest(name).digest


def test_an_interrupted_pull_resumes_without_fetching_again_what_it_had(registry, proxy, source, name, tmp_path):
    renamed(source, name)
    source.push(name, insecure=True)
    manifest = source.manifest(name)
    through_proxy = parse_name(name.replace(registry.host, proxy.host))
    target = Store(tmp_path / "target")
    proxy.reset(budget=manifest.model.size // 2)  # the connection is cut halfway through the GGUF
    with pytest.raises(RegistryError, match="lost the connection"):
        pull_model(target, through_proxy, insecure=True, min_part_size=manifest.model.size // 3, workers=3)
    assert target.manifest(through_proxy) is None
    assert not any(target.has_blob(digest) for digest in manifest.blobs)
    records = [json.loads(path.read_text()) for path in target.blobs_dir.glob("*-partial.json")]
    kept = sum(done for record in records for _, _, done in record["parts"])
    assert 0 < kept < manifest.model.size

    proxy.reset()
    total = sum(layer.size for layer in manifest.layers + (manifest.config,))
    events = []
    pulled = pull_model(target, through_proxy, events.append, insecure=True, min_part_size=manifest.model.size // 3, workers=3)
    assert proxy.blob_bytes == total - kept
    model_events = [event for event in events if event.get("digest") == manifest.model.digest]
    assert 0 < model_events[0]["completed"] <= kept and model_events[-1]["completed"] == manifest.model.size
    assert blob_files(target, pulled) == blob_files(source, manifest)
    assert not list(target.blobs_dir.glob("*-partial*"))


def test_a_connection_cut_mid_part_is_retried_from_where_it_stopped(registry, proxy, source, name, tmp_path):
    renamed(source, name)
    source.push(name, insecure=True)
    manifest = source.manifest(name)
    through_proxy = parse_name(name.replace(registry.host, proxy.host))
    cut = manifest.model.size // 2
    proxy.reset(budget=cut, once=True)
    target = Store(tmp_path / "target")
    pulled = pull_model(target, through_proxy, insecure=True)
    assert (manifest.model.digest, f"bytes={cut}-{manifest.model.size - 1}") in proxy.ranges
    assert proxy.blob_bytes == sum(layer.size for layer in manifest.layers + (manifest.config,))
    assert blob_files(target, pulled) == blob_files(source, manifest)


def test_two_pulls_of_one_model_at_once_both_succeed(registry, source, name, tmp_path):
    renamed(source, name)
    source.push(name, insecure=True)
    target = Store(tmp_path / "target")
    model = source.manifest(name).model
    results, errors = [], []

    def pull() -> None:
        try:
            results.append(pull_model(target, parse_name(name), insecure=True, min_part_size=model.size // 4, workers=4))
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            errors.append(error)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 2
    assert target.blob_path(model.digest).read_bytes() == source.blob_path(model.digest).read_bytes()
    assert not list(target.blobs_dir.glob("*-partial*"))


def test_a_corrupted_blob_is_rejected_and_the_store_is_unchanged(registry, source, name, tiny_store_root, tmp_path):
    system = f"corrupt me {uuid.uuid4().hex}"
    create_model(source, name, ModelSpec(from_model=TINY_LLAMA, system=system))
    source.push(name, insecure=True)
    digest = next(layer.digest for layer in source.manifest(name).layers if layer.media_type.endswith(".system"))
    registry.blob_file(digest).write_bytes(b"X" * len(system))
    shutil.copytree(tiny_store_root, tmp_path / "target", copy_function=os.link)
    target = Store(tmp_path / "target")
    before = files_of(target)
    with pytest.raises(UntrustedContentError, match=f"blob {digest} rejected: its bytes have digest"):
        target.pull(name, insecure=True)
    assert files_of(target, partials=False) == before
    assert not list(target.blobs_dir.glob(f"{digest.replace(':', '-')}*"))


def test_pulling_an_updated_tag_drops_the_layers_only_the_old_one_used(registry, source, name, tmp_path):
    target = Store(tmp_path / "target")
    old_system, new_system = (f"{word} {uuid.uuid4().hex}" for word in ("old", "new"))
    create_model(source, name, ModelSpec(from_model=TINY_LLAMA, system=old_system))
    source.push(name, insecure=True)
    old = target.pull(name, insecure=True)
    create_model(source, name, ModelSpec(from_model=TINY_LLAMA, system=new_system))
    source.push(name, insecure=True)
    new = target.pull(name, insecure=True)
    assert model_defaults(target, name).system == new_system
    assert all(target.has_blob(digest) for digest in new.blobs)
    assert not any(target.has_blob(digest) for digest in old.blobs - new.blobs) and old.blobs - new.blobs


def test_pulling_a_tag_the_registry_lacks_is_model_not_found(registry, tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"not found in the registry {registry.host}"):
        Store(tmp_path / "target").pull(f"{registry.host}/tests/absent:latest", insecure=True)


def test_without_insecure_a_plain_http_registry_is_refused_with_a_hint(registry, source, name):
    renamed(source, name)
    with pytest.raises(RegistryError, match="--insecure"):
        source.push(name)


# ---- the command line -----------------------------------------------------------------------------


@pytest.fixture
def no_server(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")


def test_cli_push_then_pull_with_insecure(registry, source, name, no_server, monkeypatch):
    renamed(source, name)
    monkeypatch.setenv("CORRAL_MODELS", str(source.root))
    pushed = CliRunner().invoke(main, ["push", "--insecure", name])
    assert pushed.exit_code == 0, pushed.output
    source.delete(name)
    pulled = CliRunner().invoke(main, ["pull", "--insecure", name])
    assert pulled.exit_code == 0, pulled.output
    assert source.manifest(name) is not None
    # Ollama's order: the manifest line, a bar per layer, then the closing lines below the bars.
    gguf_bar = f"pulling {source.manifest(name).model.digest[7:19]}"
    lines = ["pulling manifest", gguf_bar, "verifying sha256 digest", "writing manifest", "success"]
    positions = [pulled.output.find(line) for line in lines]
    assert -1 not in positions and positions == sorted(positions), pulled.output


def test_cli_pull_of_an_absent_model_is_one_clear_error(registry, no_server, monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "models"))
    result = CliRunner().invoke(main, ["pull", "--insecure", f"{registry.host}/tests/absent"])
    assert result.exit_code == 1
    assert f"Error: model '{registry.host}/tests/absent:latest' not found in the registry" in result.output


# ---- over HTTP, through the official ollama client ------------------------------------------------


async def in_thread(function, *args, **kwargs):
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs))


async def test_api_push_then_pull_through_the_ollama_client(registry, tiny_server, name, tmp_path):
    client = ollama.Client(host=tiny_server)
    await in_thread(client.copy, TINY_LLAMA, name)
    pushed = await in_thread(lambda: list(client.push(name, insecure=True, stream=True)))
    assert [event.status for event in pushed][-2:] == ["pushing manifest", "success"]
    await in_thread(client.delete, name)
    pulled = await in_thread(lambda: list(client.pull(name, insecure=True, stream=True)))
    statuses = [event.status for event in pulled]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layers = [event for event in pulled if event.digest]
    assert layers and all(event.status == f"pulling {event.digest[7:19]}" and event.total for event in layers)
    assert any(event.completed == event.total for event in layers)
    answer = await in_thread(client.generate, name, "Hello", options={"num_predict": 3, "temperature": 0})
    assert answer.done


async def test_api_pull_of_an_absent_model_is_404(registry, tiny_server):
    client = ollama.Client(host=tiny_server)
    with pytest.raises(ollama.ResponseError) as raised:
        await in_thread(client.pull, f"{registry.host}/tests/absent:latest", insecure=True)
    assert raised.value.status_code == 404 and "not found in the registry" in raised.value.error


async def test_api_push_to_a_plain_http_registry_without_insecure_is_502(registry, tiny_server, name):
    client = ollama.Client(host=tiny_server)
    await in_thread(client.copy, TINY_LLAMA, name)
    with pytest.raises(ollama.ResponseError) as raised:
        await in_thread(client.push, name)
    assert raised.value.status_code == 502 and "--insecure" in raised.value.error
    assert str(Path.home()) not in raised.value.error
