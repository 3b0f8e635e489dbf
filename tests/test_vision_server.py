"""Images over HTTP: Ollama's `images` on /api/generate and /api/chat, OpenAI's `image_url` parts, the projector
layer a second FROM creates, the "vision" capability, and the 400s for what is not an image or does not fit
(the tiny Gemma 3 vision model of vision_driver.py, through the real clients; marker `peers`).

The round trips (both APIs, `corral run`, `corral show`, `corral create`) run for each family of FAMILIES
(the tiny LLaVA of llava_driver.py too): a greedy answer through the server must be the one the model gives
in-process with the same image (`expected`), and differ from the answer without it.
"""

from __future__ import annotations

import base64

import attrs
import httpx
import trio
import ollama
import openai
import pytest
from conftest import _serve
from vision_references import cached

from corral.gguf import GGUFFile
from corral.modelfile import Modelfile, ModelSpec, create_model
from corral.runner.runtime import Runtime
from corral.store import PROJECTOR_MEDIA_TYPE, Store

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

VISION, TEXT = "tiny-vision:latest", "tiny-text:latest"
NUM_CTX = 160  # the Modelfile's: the tiny LLaVA's prompt with an image and its answer fit (~120 cells)
GREEDY = {"temperature": 0, "num_predict": 6}
PROMPT = "describe"
FAMILIES = ["gemma3-vision", "llava"]  # tests/vision_references.py's names
TOKENS_PER_IMAGE = {"gemma3-vision": 16, "llava": 64}
each_family = pytest.mark.parametrize("family", FAMILIES, indirect=True)


@pytest.fixture(scope="module")
def family(request) -> str:
    """The tiny vision model's family: Gemma 3 unless a test names others (`each_family`)."""
    return getattr(request, "param", "gemma3-vision")


@pytest.fixture(scope="module")
def vision_store_root(llama_cpp_dir, family, tmp_path_factory):
    """A store with the tiny model twice: with its projector (a second FROM, as a Modelfile gives it) and without."""
    reference = cached(llama_cpp_dir, family)
    store = Store(tmp_path_factory.mktemp("vision-store") / "models")
    modelfile = Modelfile.parse(f"FROM {reference.model}\nFROM {reference.projector}\nPARAMETER num_ctx {NUM_CTX}\n")
    create_model(store, VISION, ModelSpec.from_modelfile(modelfile))
    create_model(store, TEXT, ModelSpec(gguf_path=reference.model))
    return store.root, reference


@attrs.frozen
class Expected:
    """What the model gives in-process for PROMPT with the test image (and without it), greedily."""

    generated: str
    context: list[int]  # the prompt's ids (the image's rows as their placeholders) and the answer's
    chatted: str  # the reply to one user message, PROMPT with the image
    without_image: str


@pytest.fixture(scope="module")
def expected(vision_store_root) -> Expected:
    """The in-process answers, from the files the store's model was created from (the same options)."""
    _, reference = vision_store_root
    image = reference.image.read_bytes()

    async def answers() -> Expected:
        async with Runtime.open(str(reference.model), projector=str(reference.projector), num_parallel=1, num_ctx=NUM_CTX) as rt:
            async with rt.generate(PROMPT, GREEDY, images=[image]) as stream:
                generated, final = await stream.collect()
            async with rt.chat([{"role": "user", "content": PROMPT, "images": [image]}], GREEDY) as stream:
                chatted, _ = await stream.collect()
            async with rt.generate(PROMPT, GREEDY) as stream:
                without_image, _ = await stream.collect()
        return Expected(generated, list(final.context), chatted, without_image)

    answers = trio.run(answers)
    assert answers.generated != answers.without_image  # else the round trips could pass with the image dropped
    return answers


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


@each_family
async def test_show_lists_vision_for_the_model_with_a_projector_only(vision_server):
    url, _ = vision_server
    async with httpx.AsyncClient(base_url=url) as client:
        vision = (await client.post("/api/show", json={"model": VISION})).json()
        text = (await client.post("/api/show", json={"model": TEXT})).json()
    assert "vision" in vision["capabilities"] and "vision" not in text["capabilities"]
    lines = vision["modelfile"].splitlines()
    assert [line.split()[0] for line in lines if line.startswith("FROM ")] == ["FROM", "FROM"]  # the model, then its projector


@each_family
async def test_an_image_round_trips_through_ollama_generate_and_chat(vision_server_with_runner_processes, expected, family):
    url, reference = vision_server_with_runner_processes
    client = ollama.AsyncClient(host=url)
    generated = await client.generate(VISION, PROMPT, images=[reference.image.read_bytes()], options=GREEDY)
    chatted = await client.chat(VISION, [{"role": "user", "content": PROMPT, "images": [str(reference.image)]}], options=GREEDY)
    assert (generated.response, list(generated.context)) == (expected.generated, expected.context)
    assert chatted.message.content == expected.chatted
    # The image's rows are in the prompt's count (and their placeholders in the context passed back).
    assert generated.prompt_eval_count == len(expected.context) - generated.eval_count
    assert sum(1 for token in generated.context if token < 0) == TOKENS_PER_IMAGE[family]


@each_family
async def test_an_image_round_trips_through_openai_chat_completions(vision_server, expected, family):
    url, reference = vision_server
    data_url = "data:image/png;base64," + base64.b64encode(reference.image.read_bytes()).decode()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url}}]
    messages = [{"role": "user", "content": content}]
    reply = await client.chat.completions.create(model=VISION, messages=messages, max_tokens=GREEDY["num_predict"], temperature=0)
    assert reply.choices[0].message.content == expected.chatted
    assert reply.usage.prompt_tokens > TOKENS_PER_IMAGE[family]


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
        response = await client.post("/api/generate", json={"model": VISION, "prompt": "x", "images": [image] * 10, "stream": False})
    assert response.status_code == 400 and f"more than num_ctx {NUM_CTX}" in response.json()["error"]


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


@each_family
async def test_corral_show_lists_the_vision_capability(vision_server, monkeypatch):
    url, _ = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    result = await trio.to_thread.run_sync(corral, "show", VISION)
    assert result.exit_code == 0 and "vision" in result.output.split("Capabilities")[1].split("Parameters")[0]


def corral_run_describing_cat_png(tmp_path, monkeypatch, reference, *options: str):
    """`corral run tiny-vision "describe ./cat.png"` greedily, in a folder holding the test image as cat.png."""
    (tmp_path / "cat.png").write_bytes(reference.image.read_bytes())
    monkeypatch.chdir(tmp_path)
    return corral("run", VISION, f"{PROMPT} ./cat.png", "--temperature", "0", "--num-predict", str(GREEDY["num_predict"]), *options)


@each_family
async def test_corral_run_attaches_an_image_path_through_the_server(vision_server, expected, family, monkeypatch, tmp_path):
    url, reference = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    result = await trio.to_thread.run_sync(corral_run_describing_cat_png, tmp_path, monkeypatch, reference, "--verbose")
    assert result.exit_code == 0, result.output
    assert "Added image 'cat.png'" in result.stderr
    assert result.stdout == expected.chatted + "\n"  # the reply alone (the figures go to stderr)
    count = int(result.stderr.split("prompt eval count:")[1].split()[0])
    assert count > TOKENS_PER_IMAGE[family]  # the image's rows went with the text


@each_family
def test_corral_run_in_process_takes_the_projector_from_the_store(vision_store_root, expected, monkeypatch, tmp_path):
    import socket

    root, reference = vision_store_root
    with socket.socket() as sock:  # nothing listens there: the CLI runs the model itself
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("CORRAL_MODELS", str(root))
    result = corral_run_describing_cat_png(tmp_path, monkeypatch, reference)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.chatted + "\n"


@each_family
async def test_a_path_dropped_into_the_interactive_chat_attaches_the_image(vision_server, expected, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from corral.cli import main

    url, reference = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)
    (tmp_path / "a cat.png").write_bytes(reference.image.read_bytes())  # dropped into a terminal: the space escaped
    turn = f"{PROMPT} {tmp_path}/a\\ cat.png\n/bye\n"
    args = ["run", VISION, "--temperature", "0", "--num-predict", str(GREEDY["num_predict"])]
    result = await trio.to_thread.run_sync(lambda: CliRunner().invoke(main, args, input=turn, catch_exceptions=False))
    assert result.exit_code == 0, result.output
    assert f"Added image '{tmp_path}/a cat.png'" in result.stderr
    assert expected.chatted in result.stdout  # the reply to the text and the image, between the prompts


@each_family
async def test_corral_create_uploads_a_second_from_as_the_projector(vision_server, monkeypatch, tmp_path):
    url, reference = vision_server
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {reference.model}\nFROM {reference.projector}\n")
    result = await trio.to_thread.run_sync(corral, "create", "made-here", "-f", str(modelfile))
    assert result.exit_code == 0, result.output
    async with httpx.AsyncClient(base_url=url) as client:
        shown = (await client.post("/api/show", json={"model": "made-here"})).json()
    assert "vision" in shown["capabilities"] and shown["details"]["family"] == GGUFFile.open(reference.model).architecture


async def test_a_projector_alone_is_not_a_model(vision_server):
    url, reference = vision_server
    data = reference.projector.read_bytes()
    digest = "sha256:" + __import__("hashlib").sha256(data).hexdigest()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.post(f"/api/blobs/{digest}", content=data)).status_code in (200, 201)
        response = await client.post("/api/create", json={"model": "only-eyes", "files": {"mmproj.gguf": digest}, "stream": False})
    assert response.status_code == 400
