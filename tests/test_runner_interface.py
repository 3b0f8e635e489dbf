"""Both runners, the in-process Runtime and the child-process RunnerProcess, are one `Runner`: same calls, same status."""

from __future__ import annotations

import pytest
import trio

from corral.runner.interface import EmbeddingsUnsupportedError, Runner, RunnerStatus, Stream
from corral.runner.process import RunnerProcess
from corral.runner.runtime import Runtime
from tiny_gguf import write_tiny_llama

SIZES = dict(num_parallel=2, num_ctx=128, num_batch=32)
GREEDY = {"temperature": 0, "num_predict": 4}


@pytest.fixture(params=["inprocess", pytest.param("process", marks=pytest.mark.slow)])  # a child process: seconds
def open_runner(request, tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    opener = Runtime.open if request.param == "inprocess" else RunnerProcess.open
    return lambda: opener(str(path), **SIZES)


async def test_each_runner_serves_through_the_one_interface(open_runner):
    # One runner per test costs a child process's start (seconds): the read-only checks share it.
    async with open_runner() as runner:
        assert isinstance(runner, Runner)
        assert runner.alive and runner.vocab_size > 0 and runner.info.context_length >= runner.num_ctx
        ids = await runner.tokenize("hello world", add_special=False)
        async with runner.generate("hello world", GREEDY, raw=True) as stream:
            assert isinstance(stream, Stream)
            text, final = await stream.collect()
        assert final.done and final.eval_count == 4 and isinstance(text, str)
        with pytest.raises(EmbeddingsUnsupportedError, match="does not support embeddings"):
            await runner.embed(["hello"])
        if isinstance(runner, RunnerProcess):
            await runner.refresh()  # else the status is the last health check's
        status = runner.status()
        assert (status.num_ctx, status.num_parallel, status.num_batch) == (128, 2, 32)
        assert status.requests.requests == 1 and status.requests.prompt_tokens >= len(ids)
        assert status.batch.steps >= 4 and status.live_sequences == 0 and status.free_slots == 2
        assert status.cache_cells >= 128 * 2 and 0 < status.cache_used_cells <= status.cache_cells
        assert status.memory_bytes > 0


async def test_the_status_is_a_copy_that_crosses_the_wire(open_runner):
    async with open_runner() as runner:
        before = runner.status()
        async with runner.generate("hi", GREEDY, raw=True) as stream:
            await stream.collect()
        assert before.batch.steps == 0 and before.requests.requests == 0  # not a view of the live counters
        assert RunnerStatus.from_json(before.to_json()) == before


async def test_close_ends_the_runner(open_runner):
    async with open_runner() as runner:
        await runner.close()
        with trio.fail_after(10):
            await runner.exited.wait()
        assert not runner.alive


async def test_a_template_for_a_loaded_model_leaves_the_model_as_it_was(tmp_path):
    from corral.engine import load_model

    loaded = load_model(write_tiny_llama(tmp_path / "tiny.gguf"))
    before = loaded.template.source
    async with Runtime.open(loaded, num_parallel=1, num_ctx=64, num_batch=16, template="[{{ messages[0]['content'] }}]") as rt:
        assert rt.model.template.render([{"role": "user", "content": "x"}]) == "[x]"
        assert rt.model.model is loaded.model  # the same weights
    assert loaded.template.source == before
