"""/api/create and /api/blobs against a live server, through the official ollama client and raw HTTP."""

import functools
import hashlib
import json
from pathlib import Path

import httpx
import ollama
import pytest
import trio

from corral.modelfile.defaults import model_defaults
from corral.store import Store
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.real_model  # every test here uses a real model: the fast subset does not even import this module


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(server, tmp_path) -> Store:
    """The live server's store (the `server` fixture puts it under this test's tmp_path)."""
    return Store(tmp_path / "models")


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server)


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


async def in_thread(function, *args, **kwargs):
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs))


async def test_create_from_a_model_stores_its_system_and_parameters(client, store):
    parameters = {"temperature": 0.1, "stop": ["<end>"]}
    response = await in_thread(client.create, "terse", from_="smollm2", system="Be terse.", parameters=parameters)
    assert response.status == "success"
    defaults = model_defaults(store, "terse")
    assert defaults.system == "Be terse."
    assert defaults.options == {"stop": ["<end>"], "temperature": 0.1}
    assert store.manifest("terse").model == store.manifest("smollm2").model


async def test_created_model_is_listed(client):
    await in_thread(client.create, "terse", from_="smollm2", system="Be terse.")
    names = [model.model for model in (await in_thread(client.list)).models]
    assert "terse:latest" in names


async def test_show_reports_the_created_system_and_parameters(client):
    await in_thread(client.create, "terse", from_="smollm2", system="Be terse.", parameters={"temperature": 0.1})
    shown = await in_thread(client.show, "terse")
    assert "temperature" in (shown.parameters or "")
    assert "SYSTEM Be terse." in shown.modelfile


async def test_create_streams_progress_ending_in_success(client):
    events = await in_thread(lambda: list(client.create("terse", from_="smollm2", system="Be terse.", stream=True)))
    statuses = [event.status for event in events]
    assert statuses[-2:] == ["writing manifest", "success"]
    assert any(status.startswith("creating new layer sha256:") for status in statuses)
    assert any(status.startswith("using existing layer sha256:") for status in statuses)


async def test_create_from_an_uploaded_gguf_then_generate(client, http, tiny_gguf):
    digest = await in_thread(client.create_blob, tiny_gguf)
    response = await in_thread(client.create, "tiny", files={"tiny.gguf": digest}, parameters={"num_predict": 3})
    assert response.status == "success"
    body = {"model": "tiny", "prompt": "the", "stream": False, "options": {"num_predict": 3}}
    reply = await http.post("/api/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["done"] is True


async def test_reupload_and_recreate_are_idempotent(http, tiny_gguf):
    data = open(tiny_gguf, "rb").read()
    digest = sha256(data)
    assert (await http.post(f"/api/blobs/{digest}", content=data)).status_code == 201
    assert (await http.post(f"/api/blobs/{digest}", content=data)).status_code == 200
    manifests = []
    for _ in range(2):
        body = {"model": "tiny", "files": {"tiny.gguf": digest}, "system": "S", "stream": False}
        assert (await http.post("/api/create", json=body)).json() == {"status": "success"}
        listed = (await http.get("/api/tags")).json()["models"]
        manifests += [model["digest"] for model in listed if model["name"] == "tiny:latest"]
    assert len(manifests) == 2 and manifests[0] == manifests[1]


async def test_upload_streams_a_body_larger_than_one_write(http, store):
    data = bytes(range(256)) * 12_000  # about 3 MB, several writes
    digest = sha256(data)

    async def chunks():
        for start in range(0, len(data), 100_000):
            yield data[start : start + 100_000]

    assert (await http.post(f"/api/blobs/{digest}", content=chunks())).status_code == 201
    assert store.blob_path(digest).read_bytes() == data


async def test_blob_digest_mismatch_is_400_and_keeps_nothing(http, store):
    before = sorted(store.blobs_dir.iterdir())
    digest = sha256(b"announced")
    reply = await http.post(f"/api/blobs/{digest}", content=b"different")
    assert reply.status_code == 400
    assert "expected " + digest in reply.json()["error"]
    assert sorted(store.blobs_dir.iterdir()) == before


@pytest.mark.parametrize(
    "digest", ["sha256:" + "a" * 63, "sha256:" + "A" * 64, "md5:" + "a" * 64, "sha256:" + "g" * 64, "sha256:..", "blob"]
)
async def test_malformed_blob_digest_is_400(http, store, digest):
    before = sorted(store.blobs_dir.iterdir())
    reply = await http.post(f"/api/blobs/{digest}", content=b"x")
    assert reply.status_code == 400
    assert "invalid digest" in reply.json()["error"]
    assert (await http.head(f"/api/blobs/{digest}")).status_code == 400
    assert sorted(store.blobs_dir.iterdir()) == before


@pytest.mark.parametrize("digest", ["sha256:..%2F..%2Fescape", "..%2Fescape"])
async def test_a_digest_holding_a_slash_matches_no_route(http, store, digest):
    reply = await http.post(f"/api/blobs/{digest}", content=b"x")
    assert reply.status_code == 404
    assert not (store.root / "escape").exists() and not (store.root.parent / "escape").exists()


async def test_head_blob_is_404_until_uploaded(http):
    digest = sha256(b"blob")
    assert (await http.head(f"/api/blobs/{digest}")).status_code == 404
    await http.post(f"/api/blobs/{digest}", content=b"blob")
    assert (await http.head(f"/api/blobs/{digest}")).status_code == 200
    assert (await http.head(f"/api/blobs/sha256-{digest[7:]}")).status_code == 200


async def test_create_from_an_unknown_model_is_404(client):
    with pytest.raises(ollama.ResponseError) as caught:
        await in_thread(client.create, "copy", from_="absent")
    assert caught.value.status_code == 404
    assert "absent" in caught.value.error


async def test_create_from_a_blob_never_uploaded_is_400(http):
    digest = sha256(b"never uploaded")
    reply = await http.post("/api/create", json={"model": "x", "files": {"x.gguf": digest}})
    assert reply.status_code == 400
    assert f"POST /api/blobs/{digest}" in reply.json()["error"]


async def test_create_from_an_upload_that_is_not_gguf_is_400_with_the_reason(http, store):
    data = b"<html>not a model</html>"
    await http.post(f"/api/blobs/{sha256(data)}", content=data)
    reply = await http.post("/api/create", json={"model": "x", "files": {"x.gguf": sha256(data)}})
    assert reply.status_code == 400
    assert "not a usable GGUF model: not a GGUF file" in reply.json()["error"]
    assert store.manifest("x") is None


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "../x", "from": "smollm2"}, "invalid model name"),
        ({"model": "x"}, "give `from`"),
        ({"model": "x", "from": "smollm2", "quantize": "q4_K_M"}, "quantization is only supported for F32, F16 and BF16 models"),
        ({"model": "x", "from": "smollm2", "adapters": {"a.gguf": "sha256:" + "0" * 64}}, "adapters are not supported"),
        ({"model": "x", "from": "smollm2", "parameters": {"temp": 1}}, "unknown parameter 'temp'"),
        ({"model": "x", "from": "smollm2", "parameters": {"top_p": 5}}, "'top_p' must be"),
        ({"model": "x", "from": "smollm2", "messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"model": "x", "from": "smollm2", "files": {"a.gguf": "sha256:" + "0" * 64}}, "not both"),
        ({"model": "x", "files": {"a.gguf": "nope"}}, "invalid digest"),
        ({"model": "x", "modelfile": "FROM smollm2\nBOGUS 1"}, "Modelfile line 2: unknown instruction"),
    ],
)
async def test_bad_create_requests_are_400(http, body, says):
    reply = await http.post("/api/create", json=body)
    assert reply.status_code == 400
    assert says in reply.json()["error"]


async def test_legacy_modelfile_field_creates_from_a_model(http, store):
    modelfile = 'FROM smollm2\nSYSTEM """Be terse."""\nPARAMETER top_k 5\nMESSAGE user Hi'
    reply = await http.post("/api/create", json={"model": "legacy", "modelfile": modelfile})
    statuses = [json.loads(line)["status"] for line in reply.text.splitlines()]
    assert statuses[0] == "parsing modelfile" and statuses[-1] == "success"
    defaults = model_defaults(store, "legacy")
    assert (defaults.system, defaults.options, defaults.messages[0].content) == ("Be terse.", {"top_k": 5}, "Hi")


async def test_legacy_modelfile_field_reads_a_gguf_path_on_the_server(http, store, tiny_gguf):
    location = str(Path(tiny_gguf).with_name("Modelfile"))
    body = {"model": "legacy", "modelfile": "FROM ./tiny.gguf\nSYSTEM s", "path": location, "stream": False}
    reply = await http.post("/api/create", json=body)
    assert reply.json() == {"status": "success"}
    assert store.model_path("legacy").read_bytes() == open(tiny_gguf, "rb").read()
