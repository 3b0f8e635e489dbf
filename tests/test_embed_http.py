"""The embedding endpoints on a live server over a store holding all-MiniLM-L6-v2, through the
official `ollama` and `openai` clients and raw HTTP."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import ollama
import openai
import pytest
import trio
from test_embed_minilm import TEXTS, cosines, reference

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

MINILM = "all-minilm:latest"


@pytest.fixture(scope="session")
def minilm_store_root(tmp_path_factory, llama_cpp_dir):
    """A store holding the converted MiniLM as `all-minilm`, created as `corral create` would."""
    from embedding_models import minilm_gguf

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    store = Store(tmp_path_factory.mktemp("minilm-store") / "models")
    create_model(store, MINILM, ModelSpec(gguf_path=minilm_gguf(llama_cpp_dir)))
    return store.root


@pytest.fixture
async def minilm_server(minilm_store_root, tmp_path, nursery):
    from conftest import _serve, copy_store

    yield await _serve(copy_store(minilm_store_root, tmp_path / "models"), nursery)


@pytest.fixture(scope="session")
def sentence_transformer():
    import embedding_models

    return embedding_models.sentence_transformer()


async def in_thread(fn):
    return await trio.to_thread.run_sync(fn)


async def post(server: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server, timeout=120) as http:
        return await http.post(path, json=body)


def openai_client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="corral", max_retries=0)


async def test_ollama_client_embed_matches_sentence_transformers(minilm_server, sentence_transformer):
    response = await in_thread(lambda: ollama.Client(host=minilm_server).embed(model=MINILM, input=TEXTS))
    assert len(response.embeddings) == len(TEXTS)
    assert cosines(response.embeddings, reference(sentence_transformer, TEXTS)).min() >= 0.999
    assert np.allclose(np.linalg.norm(response.embeddings, axis=1), 1.0, atol=1e-5)
    assert response.prompt_eval_count > len(TEXTS)
    assert response.total_duration >= response.load_duration > 0


async def test_api_embed_takes_a_string_and_dimensions(minilm_server):
    one = (await post(minilm_server, "/api/embed", {"model": MINILM, "input": TEXTS[0], "dimensions": 32, "keep_alive": "1m"})).json()
    assert len(one["embeddings"]) == 1 and len(one["embeddings"][0]) == 32
    assert abs(np.linalg.norm(one["embeddings"][0]) - 1.0) < 1e-5
    assert one["model"] == MINILM
    nothing = (await post(minilm_server, "/api/embed", {"model": MINILM, "input": ""})).json()
    assert nothing["embeddings"] == []  # as Ollama: an empty string embeds nothing


async def test_api_embed_refuses_too_long_input_without_truncation(minilm_server):
    response = await post(minilm_server, "/api/embed", {"model": MINILM, "input": [TEXTS[0], TEXTS[-1]], "truncate": False})
    assert response.status_code == 400
    assert "longer than the context of 512" in response.json()["error"]
    assert (await post(minilm_server, "/api/embed", {"model": MINILM, "input": [TEXTS[-1]]})).status_code == 200


@pytest.mark.parametrize(
    "body, says",
    [
        ({"model": MINILM, "input": [1, 2]}, "input must be a string or a list of strings"),
        ({"model": MINILM, "input": "hi", "dimensions": 0}, "dimensions must be a positive integer"),
        ({"model": MINILM, "input": "hi", "truncate": "yes"}, "truncate must be of type bool"),
        ({"input": "hi"}, "model is required"),
    ],
)
async def test_api_embed_rejects_bad_requests(minilm_server, body, says):
    response = await post(minilm_server, "/api/embed", body)
    assert response.status_code == 400
    assert says in response.json()["error"]


async def test_legacy_embeddings_return_the_unnormalised_vector(minilm_server):
    legacy = await in_thread(lambda: ollama.Client(host=minilm_server).embeddings(model=MINILM, prompt=TEXTS[0]))
    normalised = (await post(minilm_server, "/api/embed", {"model": MINILM, "input": TEXTS[0]})).json()["embeddings"][0]
    vector = np.array(legacy.embedding)
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3  # mean pooling before Normalize is not unit length
    assert np.allclose(vector / np.linalg.norm(vector), normalised, atol=1e-5)


async def test_generation_on_an_embedding_model_is_a_400(minilm_server):
    response = await post(minilm_server, "/api/generate", {"model": MINILM, "prompt": "hello", "stream": False})
    assert response.status_code == 400
    assert "embedding model" in response.json()["error"]


async def test_openai_client_embeddings_in_base64_and_float_agree(minilm_server):
    client = openai_client(minilm_server)
    default = await in_thread(lambda: client.embeddings.create(model=MINILM, input=TEXTS[:3]))  # the client asks for base64
    floats = await in_thread(lambda: client.embeddings.create(model=MINILM, input=TEXTS[:3], encoding_format="float"))
    assert [item.index for item in floats.data] == [0, 1, 2]
    assert np.allclose([item.embedding for item in default.data], [item.embedding for item in floats.data], atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3
    assert floats.model == MINILM and floats.object == "list"


async def test_v1_embeddings_take_token_arrays_and_dimensions(minilm_server):
    async with httpx.AsyncClient(base_url=minilm_server, timeout=120) as http:
        ids = (await http.post("/api/tokenize", json={"model": MINILM, "text": TEXTS[0]})).json().get("tokens")
    text = (await post(minilm_server, "/v1/embeddings", {"model": MINILM, "input": TEXTS[0], "dimensions": 16})).json()
    tokens = (await post(minilm_server, "/v1/embeddings", {"model": MINILM, "input": [ids, ids], "dimensions": 16})).json()
    single = (await post(minilm_server, "/v1/embeddings", {"model": MINILM, "input": ids, "encoding_format": "base64"})).json()
    assert len(text["data"][0]["embedding"]) == 16
    assert len(tokens["data"]) == 2
    assert np.allclose(tokens["data"][1]["embedding"], text["data"][0]["embedding"], atol=1e-6)
    decoded = np.frombuffer(base64.b64decode(single["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (384,) and abs(np.linalg.norm(decoded) - 1.0) < 1e-5


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"model": MINILM, "input": []}, 400, "not empty"),
        ({"model": MINILM, "input": [["a"]]}, 400, "input must be"),
        ({"model": MINILM, "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "no-such-model", "input": "hi"}, 404, "not found"),
    ],
)
async def test_v1_embeddings_errors(minilm_server, body, status, says):
    response = await post(minilm_server, "/v1/embeddings", body)
    assert response.status_code == status
    assert says in response.json()["error"]["message"]


async def test_show_reports_the_embedding_capability(minilm_server):
    shown = await in_thread(lambda: ollama.Client(host=minilm_server).show(MINILM))
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo["bert.pooling_type"] == 1
