"""The runner process: a model served by `python -m corral.runner` answers as the in-process Runtime
does, and its faults (a kill, a hang, a file that does not load) end in clear errors, never in an orphan.

The real model is loaded once, for the test that compares the two runners; the lifecycle tests use a
tiny synthetic GGUF, which a child loads in about a second.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys

import pytest
import trio

import corral.runner.process as process_module
import corral.runner.runtime as runtime_module
from corral.engine import load_model
from corral.options import InvalidOptionError
from corral.runner.process import RunnerDiedError, RunnerLoadError, RunnerProcess, runner_env
from corral.runner.wire import RunnerError, chunk_from_json, chunk_to_json, error_from_json, error_to_json
from corral.runner.runtime import Runtime
from corral.runner.stream import Chunk, TokenLogprob
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow  # each test starts a runner process that imports torch: out of the fast subset (-m "not slow")

SMALL = dict(num_parallel=2, num_ctx=128, num_batch=32)
ENDLESS = {"temperature": 0, "num_predict": -1}  # with context shift, ends only when the reader leaves


@pytest.fixture
def tiny_path(tmp_path) -> str:
    return write_tiny_llama(tmp_path / "tiny.gguf")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- the wire ---------------------------------------------------------------------------------------


def test_chunks_cross_the_wire_unchanged():
    chunk = Chunk(
        text="é", token_ids=(3, 4), logprobs=(TokenLogprob(4, "é", -0.25, ((4, "é", -0.25), (9, "e", -float("inf")))),),
        done=True, done_reason="stop", prompt_eval_count=7, eval_count=2, context=(1, 2, 3, 4),
    )
    assert chunk_from_json(json.loads(json.dumps(chunk_to_json(chunk)))) == chunk


def test_corral_errors_keep_their_type_across_the_wire():
    error = error_from_json(error_to_json(InvalidOptionError("option 'top_k' must be an integer")))
    assert type(error) is InvalidOptionError and str(error) == "option 'top_k' must be an integer"
    assert type(error_from_json({"type": "SomeTorchError", "message": "boom"})) is RunnerError


def test_the_child_inherits_only_what_it_needs(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("CORRAL_LOAD_PLUGINS", "torch,llama")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    env = runner_env({"EXTRA": "1"})
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["CORRAL_LOAD_PLUGINS"] == "torch,llama" and env["CUDA_VISIBLE_DEVICES"] == "1" and env["EXTRA"] == "1"
    assert env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize("method", ["generate", "chat", "tokenize", "detokenize"])
def test_the_runner_process_takes_the_runtimes_arguments(method):
    def parameters(cls) -> list:
        return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, method)).parameters.values()]

    assert parameters(RunnerProcess) == parameters(Runtime)


# -- the real model -------------------------------------------------------------------------------


@pytest.mark.real_model
async def test_process_runner_answers_like_the_in_process_runtime(smollm2_path, monkeypatch):
    messages = [{"role": "user", "content": "Name three colors."}]
    greedy = {"temperature": 0, "num_predict": 24}
    in_process = {}

    async def preload():  # while the child loads: the two loads overlap
        in_process["model"] = await trio.to_thread.run_sync(load_model, smollm2_path)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(preload)
        async with RunnerProcess.open(smollm2_path, num_parallel=2, num_ctx=1024, num_batch=128) as runner:
            async with runner.generate("Why is the sky blue?", greedy) as stream:
                remote_text, remote_final = await stream.collect()
            async with runner.chat(messages, greedy) as stream:
                remote_chat, _ = await stream.collect()
            ids = await runner.tokenize("Hello, wörld!")
            round_trip = await runner.detokenize(ids)
            vocab_size = runner.vocab_size
    monkeypatch.setattr(runtime_module, "load_model", lambda *args, **kwargs: in_process["model"])
    async with Runtime.open(str(smollm2_path), num_parallel=2, num_ctx=1024, num_batch=128) as runtime:
        async with runtime.generate("Why is the sky blue?", greedy) as stream:
            local_text, local_final = await stream.collect()
        async with runtime.chat(messages, greedy) as stream:
            local_chat, _ = await stream.collect()
        local_ids = await runtime.tokenize("Hello, wörld!")
    assert remote_text == local_text and remote_text
    assert remote_final.context == local_final.context and remote_final.eval_count == 24
    assert remote_chat == local_chat and remote_chat
    assert ids == local_ids and round_trip.endswith("Hello, wörld!")
    assert vocab_size == in_process["model"].tokenizer.vocab_size


# -- faults and lifecycle -------------------------------------------------------------------------


async def test_a_runner_killed_mid_stream_fails_the_stream_and_a_new_one_serves(tiny_path):
    async with RunnerProcess.open(tiny_path, **SMALL) as runner:
        async with runner.generate("hello", ENDLESS) as stream:
            with pytest.raises(RunnerDiedError, match="SIGKILL"):
                async for chunk in stream:
                    if chunk.text:
                        os.kill(runner.pid, signal.SIGKILL)
        assert not runner.alive
        with pytest.raises(RunnerDiedError):
            await runner.tokenize("hello")
    async with RunnerProcess.open(tiny_path, **SMALL) as fresh:
        async with fresh.generate("hello", {"temperature": 0, "num_predict": 4}) as stream:
            _, final = await stream.collect()
    assert final.done and final.eval_count == 4


async def test_a_runner_that_crashes_with_a_traceback_keeps_it_out_of_the_error(tiny_path, tmp_path, monkeypatch, caplog):
    # The child's step raises (a bug): its traceback goes to the server's log, never into the error
    # message a client would see. sitecustomize runs in the child at start-up (PYTHONPATH is passed on).
    (tmp_path / "sitecustomize.py").write_text(
        "from corral.runner import batching\n"
        "def broken(self, *args):\n"
        "    raise RuntimeError('a bug in /srv/corral/secret_path.py')\n"
        "batching.BatchingActor._execute = broken\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    with caplog.at_level("WARNING", logger="corral.runner"):
        async with RunnerProcess.open(tiny_path, **SMALL) as runner:
            with pytest.raises(RunnerDiedError) as raised:
                async with runner.generate("hello", {"temperature": 0, "num_predict": 4}) as stream:
                    await stream.collect()
    message = str(raised.value)
    assert "during a generation" in message and "server's log" in message
    assert "Traceback" not in message and "File " not in message and "secret_path" not in message
    assert "Traceback" in caplog.text and "secret_path" in caplog.text


async def test_a_file_that_does_not_load_raises_the_childs_reason(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    with pytest.raises(RunnerLoadError, match="not a GGUF file"):
        async with RunnerProcess.open(garbage, **SMALL):
            pass  # pragma: no cover


async def test_closing_reaps_the_child(tiny_path, monkeypatch):
    # The clean exit is what is checked, not its speed: on shared cores the child's shutdown can take
    # longer than the 5 s after which close() would kill it.
    monkeypatch.setattr(process_module, "STOP_TIMEOUT", 120.0)
    async with RunnerProcess.open(tiny_path, **SMALL) as runner:
        pid = runner.pid
        assert not gone(pid)
    assert gone(pid) and runner.returncode == 0


async def test_request_errors_keep_their_type_and_the_runner_serves_on(tiny_path):
    async with RunnerProcess.open(tiny_path, **SMALL) as runner:
        with pytest.raises(InvalidOptionError, match="temperature"):
            async with runner.generate("hello", {"temperature": "hot"}):
                pass  # pragma: no cover
        assert await runner.detokenize(await runner.tokenize("hello", add_special=False)) == "hello"


async def test_a_template_replaces_the_files_chat_template(tiny_path):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    async with RunnerProcess.open(tiny_path, template=template, **SMALL) as runner:
        async with runner.chat([{"role": "user", "content": "hi"}], {"temperature": 0, "num_predict": 1}) as stream:
            _, final = await stream.collect()
        prompt = await runner.detokenize(list(final.context[: final.prompt_eval_count]))
    assert prompt.endswith("<<hi>>")


async def test_leaving_a_stream_early_ends_the_childs_sequence(tiny_path):
    async with RunnerProcess.open(tiny_path, **SMALL) as runner:
        async with runner.generate("hello", ENDLESS) as stream:
            async for _ in stream:
                break
        with trio.fail_after(10):
            while (status := await runner.refresh()).live_sequences or status.free_slots != SMALL["num_parallel"]:
                await trio.sleep(0.05)


async def test_a_hung_runner_is_killed_by_its_health_check(tiny_path, monkeypatch):
    monkeypatch.setattr(process_module, "HEALTH_TIMEOUT", 0.3)
    async with RunnerProcess.open(tiny_path, health_interval=0.1, **SMALL) as runner:
        os.kill(runner.pid, signal.SIGSTOP)
        with trio.fail_after(10):
            await runner.exited.wait()
        assert not runner.alive
        with pytest.raises(RunnerDiedError, match="health checks"):
            await runner.tokenize("hello")


async def test_the_child_exits_when_its_stdin_closes(tiny_path):
    command = [sys.executable, "-m", "corral.runner", "--model", tiny_path, "--num-parallel", "1", "--num-ctx", "64"]
    child = await trio.lowlevel.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # A bound for a hang, not a speed check: a child's start (torch's import) takes many seconds on
        # cores that other jobs share.
        with trio.fail_after(120):
            ready = json.loads(await child.stdout.receive_some(1 << 16))
            assert ready["pid"] == child.pid
            await child.stdin.aclose()  # what the kernel does when the parent dies, even by kill -9
            assert await child.wait() == 0
    finally:
        child.kill()
        await child.wait()
