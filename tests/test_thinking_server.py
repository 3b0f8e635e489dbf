"""Thinking end to end: tiny random models carrying real thinking templates (llama.cpp's models/templates),
served live, driven by the official `ollama` and `openai` clients.

DeepSeek R1's generation prompt opens the thinking block itself, so whatever a random model writes (short of
`</think>`) is its thinking: deterministic. Qwen 3's `enable_thinking` switch shows in the prompt's length.
"""

from __future__ import annotations

import pathlib

import ollama
import openai
import pytest
import trio

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

TEMPLATES = {"r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja"}
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
OPTIONS = {"temperature": 1.0, "seed": 7, "num_predict": 8}  # greedy, a random model may only repeat a newline


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


@pytest.fixture(scope="session")
def think_store_root(tmp_path_factory, llama_cpp_dir) -> pathlib.Path:
    from conftest import CHATML
    from tiny_gguf import write_tiny_llama

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    path = write_tiny_llama(tmp_path_factory.mktemp("think-gguf") / "llama.gguf", context_length=2048)
    store = Store(tmp_path_factory.mktemp("think-store") / "models")
    for name, file in TEMPLATES.items():
        template = (llama_cpp_dir / "models" / "templates" / file).read_text()
        create_model(store, f"tiny-{name}:latest", ModelSpec(gguf_path=path, template=template))
    create_model(store, "tiny-plain:latest", ModelSpec(gguf_path=path, template=CHATML))
    return store.root


@pytest.fixture
async def think_server(think_store_root, tmp_path, nursery):
    from conftest import _serve, copy_store

    yield await _serve(copy_store(think_store_root, tmp_path / "models"), nursery)


def ollama_chat(server: str, model: str, **kwargs):
    return ollama.Client(host=server).chat(model=model, messages=ASK, options=OPTIONS, **kwargs)


def openai_chat(server: str, model: str, **kwargs):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=1.0, seed=7, **kwargs)


async def test_ollama_thinking_comes_in_its_own_field(think_server):
    reply = await in_thread(lambda: ollama_chat(think_server, "tiny-r1", think=True))
    assert reply.message.thinking and reply.message.content == ""


async def test_ollama_streamed_thinking_joins_to_the_whole(think_server):
    whole = await in_thread(lambda: ollama_chat(think_server, "tiny-r1", think=True))
    parts = await in_thread(lambda: list(ollama_chat(think_server, "tiny-r1", think=True, stream=True)))
    assert "".join(part.message.thinking or "" for part in parts) == whole.message.thinking
    assert sum(1 for part in parts if part.message.thinking) > 1  # it streams, piece by piece


async def test_ollama_think_false_turns_the_templates_switch_off(think_server):
    on = await in_thread(lambda: ollama_chat(think_server, "tiny-qwen3", think=True))
    off = await in_thread(lambda: ollama_chat(think_server, "tiny-qwen3", think=False))
    # Qwen 3 without thinking gets an empty <think>\n\n</think>\n\n block in its prompt.
    assert off.prompt_eval_count > on.prompt_eval_count
    assert off.message.content and not off.message.thinking


async def test_openai_reasoning_content_holds_the_thinking(think_server):
    reply = await in_thread(lambda: openai_chat(think_server, "tiny-r1", reasoning_effort="medium"))
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] and not message.content


async def test_openai_streams_reasoning_content_deltas(think_server):
    whole = await in_thread(lambda: openai_chat(think_server, "tiny-r1", reasoning_effort="medium"))
    stream = await in_thread(lambda: list(openai_chat(think_server, "tiny-r1", reasoning_effort="medium", stream=True)))
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == whole.choices[0].message.model_extra["reasoning_content"]


async def test_openai_without_reasoning_effort_the_templates_default_holds(think_server):
    # This template thinks only when enable_thinking is set.
    reply = await in_thread(lambda: openai_chat(think_server, "tiny-r1"))
    assert reply.choices[0].message.content and not (reply.choices[0].message.model_extra or {}).get("reasoning_content")


async def test_openai_reasoning_effort_none_turns_thinking_off(think_server):
    reply = await in_thread(lambda: openai_chat(think_server, "tiny-r1", reasoning_effort="none"))
    message = reply.choices[0].message
    assert message.content and not (message.model_extra or {}).get("reasoning_content")


async def test_a_model_that_cannot_think_is_400_in_both_apis(think_server):
    with pytest.raises(ollama.ResponseError, match="does not support thinking"):
        await in_thread(lambda: ollama_chat(think_server, "tiny-plain", think=True))
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        await in_thread(lambda: openai_chat(think_server, "tiny-plain", reasoning_effort="high"))


async def test_think_false_on_a_model_that_cannot_think_is_accepted(think_server):
    reply = await in_thread(lambda: ollama_chat(think_server, "tiny-plain", think=False))
    assert reply.message.content


async def test_a_bad_think_value_is_400(think_server):
    with pytest.raises(ollama.ResponseError, match="think must be"):
        await in_thread(lambda: ollama.Client(host=think_server)._request_raw(
            "POST", "/api/chat", json={"model": "tiny-r1", "messages": ASK, "think": "maximum", "stream": False}))


# --- the CLI: corral run --think, /set think ----------------------------------------------------------


@pytest.fixture
def cli(think_server, monkeypatch, tmp_path):
    """`corral` in a worker thread against the live server."""
    import functools

    from click.testing import CliRunner

    from corral.cli import main

    monkeypatch.setenv("CORRAL_HOST", think_server.removeprefix("http://"))
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "empty-store"))

    async def invoke(*args, input=None):
        call = functools.partial(CliRunner().invoke, main, [str(a) for a in args], input=input, catch_exceptions=False)
        return await trio.to_thread.run_sync(call)

    return invoke


async def test_run_think_shows_the_thinking_apart(cli):
    result = await cli("run", "tiny-r1", "Why?", "--think", "--temperature", 1, "--seed", 7, "--num-predict", 8)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Thinking...\n")


async def test_run_think_on_a_model_that_cannot_is_a_clear_error(cli):
    result = await cli("run", "tiny-plain", "Why?", "--think", "--num-predict", 4)
    assert result.exit_code != 0 and "does not support thinking" in result.output


async def test_set_think_in_the_chat(cli, monkeypatch):
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)
    script = "/set parameter seed 7\n/set think high\nWhy?\n/set nothink\nWhy?\n/set think maximal\n/bye\n"
    result = await cli("run", "tiny-r1", "--num-predict", 8, input=script)
    assert result.exit_code == 0, result.output
    assert "Set 'think' mode to high." in result.output and "Set 'nothink' mode." in result.output
    assert result.output.count("Thinking...") == 1
    assert "Couldn't set think" in result.output


async def test_show_lists_thinking_among_the_capabilities(think_server):
    client = ollama.Client(host=think_server)
    assert "thinking" in (await in_thread(client.show, "tiny-r1")).capabilities
    assert "thinking" not in (await in_thread(client.show, "tiny-plain")).capabilities


def ollama_generate(server: str, model: str, **kwargs):
    return ollama.Client(host=server).generate(model=model, prompt="Why is the sky blue?", options=OPTIONS, **kwargs)


async def test_ollama_generate_thinking_comes_in_its_own_field(think_server):
    """As on /api/chat: R1's prompt opens the thinking block, so all the random model writes is thinking."""
    reply = await in_thread(lambda: ollama_generate(think_server, "tiny-r1", think=True))
    assert reply.thinking and "<think>" not in reply.thinking and not reply.response
    assert reply.eval_count == OPTIONS["num_predict"] and reply.context
    plain = await in_thread(lambda: ollama_generate(think_server, "tiny-r1"))
    assert plain.thinking is None and plain.response  # without think, the text is the response, as Ollama


async def test_ollama_generate_streams_thinking_chunks(think_server):
    chunks = await in_thread(lambda: list(ollama_generate(think_server, "tiny-r1", think=True, stream=True)))
    thinking = "".join(chunk.thinking or "" for chunk in chunks)
    whole = await in_thread(lambda: ollama_generate(think_server, "tiny-r1", think=True))
    assert thinking == whole.thinking and sum(1 for chunk in chunks if chunk.thinking) > 1
    assert chunks[-1].done and not "".join(chunk.response for chunk in chunks)


async def test_ollama_generate_think_switches_the_template(think_server):
    """Qwen 3's prompt grows by the empty thinking block when thinking is off."""
    on = await in_thread(lambda: ollama_generate(think_server, "tiny-qwen3", think=True))
    off = await in_thread(lambda: ollama_generate(think_server, "tiny-qwen3", think=False))
    assert off.prompt_eval_count > on.prompt_eval_count


async def test_ollama_generate_think_on_a_model_that_cannot_think_is_400(think_server):
    with pytest.raises(ollama.ResponseError, match="does not support thinking") as error:
        await in_thread(lambda: ollama_generate(think_server, "tiny-plain", think=True))
    assert error.value.status_code == 400
