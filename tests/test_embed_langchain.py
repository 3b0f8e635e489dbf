"""Embeddings through LangChain's `langchain-ollama` (OllamaEmbeddings) and `langchain-openai` (OpenAIEmbeddings), as
retrieval pipelines call them, against a live server of a tiny random nomic-bert: each vector is the one the runtime
computes for that text directly, and a document and a query of the same text embed alike."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import trio

pytestmark = pytest.mark.slow  # a server driven through LangChain: out of the fast subset (-m "not slow")

MODEL = "tiny-nomic"
TEXTS = ["the cat sat on the mat", "a dog", "Ünïcödé ströng — 東京", "a longer text " * 20]  # the last is longer than the context: truncated


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory) -> pathlib.Path:
    from test_embed_architectures import write_tiny_nomic_bert

    path = tmp_path_factory.mktemp("lc-nomic") / "nomic.gguf"
    write_tiny_nomic_bert(path)
    return path


@pytest.fixture
async def embed_server(encoder_file, tmp_path, nursery):
    from conftest import _serve

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    store = Store(tmp_path / "models")
    create_model(store, f"{MODEL}:latest", ModelSpec(gguf_path=encoder_file))
    yield await _serve(store.root, nursery)


@pytest.fixture
async def expected(encoder_file) -> np.ndarray:
    """The runtime's own L2-normalised vectors for TEXTS, in the server's default precision."""
    from corral.runner.runtime import Runtime

    async with Runtime.open(encoder_file, num_parallel=1) as runtime:
        return np.array((await runtime.embed(TEXTS)).embeddings)


async def in_thread(fn):
    return await trio.to_thread.run_sync(fn)


def close(got, want) -> bool:
    return np.allclose(np.array(got), want, atol=1e-5)


async def test_ollama_embeddings_documents_and_query(langchain_ollama, embed_server, expected):
    embeddings = langchain_ollama.OllamaEmbeddings(base_url=embed_server, model=MODEL)
    documents = await in_thread(lambda: embeddings.embed_documents(TEXTS))
    assert close(documents, expected)
    assert close(await in_thread(lambda: embeddings.embed_query(TEXTS[0])), expected[0])


async def test_openai_embeddings_documents_and_query(langchain_openai, embed_server, expected):
    # check_embedding_ctx_length=False: send the texts themselves, not tiktoken's ids of them (OpenAI's vocabulary, not the
    # model's), as LangChain documents for OpenAI-compatible servers.
    embeddings = langchain_openai.OpenAIEmbeddings(base_url=f"{embed_server}/v1", api_key="unused", model=MODEL,
                                                   check_embedding_ctx_length=False, max_retries=0)
    documents = await in_thread(lambda: embeddings.embed_documents(TEXTS))
    assert close(documents, expected)
    assert close(await in_thread(lambda: embeddings.embed_query(TEXTS[2])), expected[2])


async def test_openai_embeddings_with_dimensions_are_shortened_and_renormalised(langchain_openai, embed_server, expected):
    embeddings = langchain_openai.OpenAIEmbeddings(base_url=f"{embed_server}/v1", api_key="unused", model=MODEL, dimensions=16,
                                                   check_embedding_ctx_length=False, max_retries=0)
    (vector,) = await in_thread(lambda: embeddings.embed_documents(TEXTS[:1]))
    want = expected[0][:16] / np.linalg.norm(expected[0][:16])
    assert len(vector) == 16 and close(vector, want)
