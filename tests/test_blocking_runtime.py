"""The Runtime for blocking callers, on a tiny synthetic model: chunks, errors, and leaving early."""

import concurrent.futures

import pytest

import corral
from corral.errors import CorralError
from corral.options import InvalidOptionError
from corral.runner.blocking import BlockingRuntime
from tiny_gguf import write_tiny_llama

ENDLESS = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return corral.load_model(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture
def runtime(tiny):
    with BlockingRuntime(tiny, num_ctx=64) as rt:
        yield rt


def test_chunks_end_with_the_final_counts(runtime):
    chunks = list(runtime.generate("hello", {**ENDLESS, "num_predict": 5}, raw=True))
    final = chunks[-1]
    assert final.done and final.done_reason == "length" and final.eval_count == 5
    assert sum(len(chunk.token_ids) for chunk in chunks) == 5


def test_a_bad_option_is_raised_to_the_reader(runtime):
    with pytest.raises(InvalidOptionError, match="'top_k' must be an integer"):
        list(runtime.generate("hello", {"top_k": "many"}, raw=True))


def test_leaving_early_frees_the_only_slot(runtime):
    endless = runtime.generate("hello", ENDLESS, raw=True)
    next(endless), next(endless)
    endless.close()
    # One slot: a generation still holding it would keep this one waiting forever.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        after = pool.submit(lambda: list(runtime.generate("hello", {**ENDLESS, "num_predict": 3}, raw=True)))
        assert after.result(timeout=60)[-1].eval_count == 3


def test_greedy_answers_repeat(runtime):
    first, second = ("".join(c.text for c in runtime.generate("hello", {**ENDLESS, "num_predict": 8}, raw=True)) for _ in range(2))
    assert first == second


def test_a_model_that_cannot_load_raises_from_the_constructor(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(CorralError, match="not a GGUF"):
        BlockingRuntime(str(junk), num_ctx=64)
