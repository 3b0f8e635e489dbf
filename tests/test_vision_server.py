"""Images over HTTP: Ollama's `images` on /api/generate and /api/chat, OpenAI's `image_url` parts, the projector
layer a second FROM creates, the "vision" capability, and the 400s for what is not an image or does not fit
(the tiny Gemma 3 vision model of vision_driver.py, through the real clients; marker `peers`)."""

from __future__ import annotations

import base64

import httpx
import trio
import ollama
import openai
import pytest
from conftest import _serve
from vision_references import cached

from corral.modelfile import Modelfile, ModelSpec, create_model
from corral.store import PROJECTOR_MEDIA_TYPE, Store

VISION, TEXT = "tiny-vision:latest", "tiny-text:latest"


@pytest.fixture(scope="module")
def vision_store_root(llama_cpp_dir, tmp_path_factory):
    """A store with the tiny model twice: with its projector (a second FROM, as a Modelfile gives it) and without."""
    reference = cached(llama_cpp_dir)
    store = Store(tmp_path_factory.mktemp("vision-store") / "models")
    modelfile = Modelfile.parse(f"FROM {reference.model}\nFROM {reference.projector}\nPARAMETER num_ctx 96\n")
    create_model(store, VISION, ModelSpec.from_modelfile(modelfile))
    create_model(store, TEXT, ModelSpec(gguf_path=reference.model))
    return store.root, reference


async def _vision_server(vision_store_root, tmp_path, nursery):
    from conftest import copy_store

    root, reference = vision_store_root
    return await _serve(copy_store(root, tmp_path / "models"), nursery), reference


@pytest.fixture
async def vision_server(vision_store_root, tmp_path, nursery, monkeypatch):
    """A server over a copy of the store, running its models in-process (quick to start)."""
    monkeypatch.setenv("CORRAL_RUNNER", "inprocess")
    yield await _vision_server(vision_store_root, tmp_path, nursery)


@pytest.fixture
async def vision_server_with_runner_processes(vision_store_root, tmp_path, nursery):
    """The same, with each model in a runner process as by default: images cross its wire."""
    yield await _vision_server(vision_store_root, tmp_path, nursery)


def test_a_second_from_becomes_the_projector_layer(vision_store_root):
    root, reference = vision_store_root
    manifest = Store(root).manifest(VISION)
    assert manifest.layer(PROJECTOR_MEDIA_TYPE).size == reference.projector.stat().st_size
    assert Store(root).projector_path(TEXT) is None


async def test_show_lists_vision_for_the_model_with_a_projector_only(vision_server):
    url, _ = vision_server
    async with httpx.AsyncClient(base_url=url) as client:
        vision = (await client.post("/api/show", json={"model": VISION})).json()
        text = (await client.post("/api/show", json={"model": TEXT})).json()
    assert "vision" in vision["capabilities"] and "vision" not in text["capabilities"]
    lines = vision["modelfile"].splitlines()
    assert [line.split()[0] for line in lines if line.startswith("FROM ")] == ["FROM", "FROM"]  # the model, then its projector


async def test_an_image_round_trips_through_ollama_generate_and_chat(vision_server_with_runner_processes):
    url, reference = vision_server_with_runner_processes
    client = ollama.AsyncClient(host=url)
    options = {"temperature": 0, "num_predict": 3}
    generated = await client.generate(VISION, "describe", images=[reference.image.read_bytes()], options=options)
    chatted = await client.chat(VISION, [{"role": "user", "content": "describe", "images": [str(reference.image)]}], options=options)
    plain = await client.generate(VISION, "describe", options=options)
    assert generated.done and chatted.done
    # The image's rows are in the prompt's count: 16 embeddings and its markers more than the text alone.
    assert generated.prompt_eval_count >= plain.prompt_eval_count + 16
    assert chatted.prompt_eval_count >= 16


async def test_an_image_round_trips_through_openai_chat_completions(vision_server):
    url, reference = vision_server
    data_url = "data:image/png;base64," + base64.b64encode(reference.image.read_bytes()).decode()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": data_url}}]
    reply = await client.chat.completions.create(model=VISION, messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens >= 16


@pytest.mark.parametrize(
    "body, says",
    [
        ({"model": VISION, "prompt": "x", "images": ["bm90IGFuIGltYWdl"]}, "not an image"),  # "not an image", base64
        ({"model": VISION, "prompt": "x", "images": ["%%%"]}, "not valid base64"),
        ({"model": VISION, "prompt": "x", "images": "abc"}, "must be of type list"),
        ({"model": TEXT, "prompt": "x", "images": ["bm90IGFuIGltYWdl"]}, "does not support images"),
    ],
    ids=["not-an-image", "bad-base64", "not-a-list", "text-only-model"],
)
async def test_bad_images_are_a_400_with_the_reason(vision_server, body, says):
    url, _ = vision_server
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/api/generate", json={**body, "stream": False})
        assert response.status_code == 400 and says in response.json()["error"]
        assert (await client.get("/api/version")).status_code == 200  # the server keeps serving


async def test_more_images_than_the_context_holds_are_a_400(vision_server):
    url, reference = vision_server
    image = base64.b64encode(reference.image.read_bytes()).decode()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/api/generate", json={"model": VISION, "prompt": "x", "images": [image] * 6, "stream": False})
    assert response.status_code == 400 and "more than num_ctx 96" in response.json()["error"]


async def test_http_image_urls_are_refused_unless_the_server_fetches_them(vision_server):
    url, _ = vision_server
    content = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/v1/chat/completions", json={"model": VISION, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and "CORRAL_FETCH_IMAGE_URLS" in response.json()["error"]["message"]


# --- the CLI --------------------------------------------------------------------------------------


def corral(*args: str):
    from click.testing import CliRunner

    from corral.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


async def test_corral_show_lists_the_vision_capability(vision_server, monkeypatch):
    url, _ = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    result = await trio.to_thread.run_sync(corral, "show", VISION)
    assert result.exit_code == 0 and "vision" in result.output.split("Capabilities")[1].split("Parameters")[0]


async def test_corral_run_attaches_an_image_path_through_the_server(vision_server, monkeypatch, tmp_path):
    url, reference = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    image = tmp_path / "cat.png"
    image.write_bytes(reference.image.read_bytes())
    result = await trio.to_thread.run_sync(corral, "run", VISION, f"describe {image}", "--temperature", "0", "--num-predict", "2", "--verbose")
    assert result.exit_code == 0, result.output
    assert f"Added image '{image}'" in result.output
    count = int(result.output.split("prompt eval count:")[1].split()[0])
    assert count >= 16  # the image's rows went with the text


def test_corral_run_in_process_takes_the_projector_from_the_store(vision_store_root, monkeypatch, tmp_path):
    import socket

    root, reference = vision_store_root
    with socket.socket() as sock:  # nothing listens there: the CLI runs the model itself
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("CORRAL_MODELS", str(root))
    image = tmp_path / "cat.png"
    image.write_bytes(reference.image.read_bytes())
    result = corral("run", VISION, f"describe {image}", "--temperature", "0", "--num-predict", "2", "--verbose")
    assert result.exit_code == 0, result.output
    assert int(result.output.split("prompt eval count:")[1].split()[0]) >= 16


async def test_corral_create_uploads_a_second_from_as_the_projector(vision_server, monkeypatch, tmp_path):
    url, reference = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {reference.model}\nFROM {reference.projector}\n")
    result = await trio.to_thread.run_sync(corral, "create", "made-here", "-f", str(modelfile))
    assert result.exit_code == 0, result.output
    async with httpx.AsyncClient(base_url=url) as client:
        shown = (await client.post("/api/show", json={"model": "made-here"})).json()
    assert "vision" in shown["capabilities"] and shown["details"]["family"] == "gemma3"


async def test_a_projector_alone_is_not_a_model(vision_server):
    url, reference = vision_server
    data = reference.projector.read_bytes()
    digest = "sha256:" + __import__("hashlib").sha256(data).hexdigest()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.post(f"/api/blobs/{digest}", content=data)).status_code in (200, 201)
        response = await client.post("/api/create", json={"model": "only-eyes", "files": {"mmproj.gguf": digest}, "stream": False})
    assert response.status_code == 400
