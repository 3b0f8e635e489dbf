"""Tool calls end to end: a tiny random model carrying a real model family's template (llama.cpp's
models/templates), served by a live corral server, driven by the official `openai` and `ollama` clients.

A random model only writes a call when it is made to: `tool_choice` (OpenAI) forces one, its arguments
constrained to the tool's schema, and an Ollama `format` schema of the Llama 3 call object makes the
bare-JSON family's call. So every result here is deterministic, and a parsed call always validates.
"""

from __future__ import annotations

import json
import pathlib

import httpx
import ollama
import openai
import pytest
import trio

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

CITY = {"type": "string", "description": "The city", "enum": ["Paris", "Rome", "Lima"]}  # described: Command-R+ prints it
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}}
TEMPLATES = {
    "hermes": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}
# Families whose call is no JSON object after a prefix: forced end to end too (one test each keeps the suite quick).
OTHER_TEMPLATES = {
    "qwen3-coder": "Qwen3-Coder.jinja",
    "deepseek-r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "command-r-plus": "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


@pytest.fixture(scope="session")
def tool_store_root(tmp_path_factory, llama_cpp_dir) -> pathlib.Path:
    """A store with one tiny llama per family, each carrying that family's real template, and one whose
    template renders no tools."""
    from conftest import CHATML
    from tiny_gguf import write_tiny_llama

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    path = write_tiny_llama(tmp_path_factory.mktemp("tool-gguf") / "llama.gguf", context_length=4096)
    store = Store(tmp_path_factory.mktemp("tool-store") / "models")
    for family, name in {**TEMPLATES, **OTHER_TEMPLATES}.items():
        template = (llama_cpp_dir / "models" / "templates" / name).read_text()
        create_model(store, f"tiny-{family}:latest", ModelSpec(gguf_path=path, template=template))
    create_model(store, "tiny-notools:latest", ModelSpec(gguf_path=path, template=CHATML))
    return store.root


@pytest.fixture
async def tool_server(tool_store_root, tmp_path, nursery):
    from conftest import _serve, copy_store

    yield await _serve(copy_store(tool_store_root, tmp_path / "models"), nursery)


def openai_client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def forced(server: str, family: str, **kwargs):
    return openai_client(server).chat.completions.create(
        **{"model": f"tiny-{family}", "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0, **kwargs}
    )


@pytest.mark.parametrize("family", sorted(TEMPLATES))
async def test_openai_required_tool_choice_returns_a_valid_call(tool_server, family):
    reply = await in_thread(lambda: forced(tool_server, family, tool_choice="required", parallel_tool_calls=False))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments)["city"] in CITY["enum"]
    assert not choice.message.content


@pytest.mark.parametrize("family", sorted(TEMPLATES))
async def test_openai_named_tool_choice_calls_that_function(tool_server, family):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = await in_thread(lambda: forced(tool_server, family, tool_choice=named))
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert set(json.loads(call.function.arguments)) == {"city"}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
async def test_openai_stream_sends_tool_call_deltas_like_vllm(tool_server, family):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = await in_thread(lambda: list(forced(tool_server, family, tool_choice=named, stream=True)))
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    call_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    head, *fragments = call_deltas
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert len(fragments) > 2  # the arguments stream as they are generated, not as one piece at the end
    assert not _decodes("".join(f.function.arguments for f in fragments[:-1]))
    arguments = json.loads("".join(f.function.arguments for f in fragments))
    assert arguments["city"] in CITY["enum"]
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas)


def _decodes(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize("family", sorted(TEMPLATES))
async def test_openai_stream_accumulates_to_the_whole_reply(tool_server, family):
    """The deltas, accumulated as the openai client's stream helper does, give the non-streaming reply's calls."""
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False, "seed": 1, "temperature": 1.0}
    whole = await in_thread(lambda: forced(tool_server, family, **kwargs))

    def accumulated():
        client = openai_client(tool_server)
        with client.chat.completions.stream(model=f"tiny-{family}", messages=ASK, tools=[WEATHER, TIME], max_tokens=200, **kwargs) as stream:
            for _ in stream:
                pass
            return stream.get_final_completion()

    streamed = await in_thread(accumulated)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == expected
    assert streamed.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("family", sorted(OTHER_TEMPLATES))
async def test_openai_forced_calls_work_for_the_other_families(tool_server, family):
    """A named call and a required one (several in parallel allowed) come back parsed and valid, streamed or not."""
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = await in_thread(lambda: forced(tool_server, family, tool_choice=named, max_tokens=400))
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["city"] in CITY["enum"]
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    stream = await in_thread(lambda: list(forced(tool_server, family, tool_choice="required", parallel_tool_calls=False, max_tokens=400, stream=True)))
    deltas = [d.tool_calls[0] for c in stream if c.choices for d in [c.choices[0].delta] if d.tool_calls]
    assert deltas, [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].function.name in ("get_weather", "get_time") and deltas[0].id.startswith("call_")
    calls = {}
    for delta in deltas:
        calls[delta.index] = calls.get(delta.index, "") + delta.function.arguments
    assert calls and all(json.loads(arguments)["city"] in CITY["enum"] for arguments in calls.values())
    assert len(deltas) > 3  # a head, then the arguments in fragments as they are written, not in one piece at the end
    assert not "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


async def test_openai_tool_choice_none_parses_no_call(tool_server):
    reply = await in_thread(lambda: forced(tool_server, "hermes", tool_choice="none", max_tokens=8))
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_openai_tool_results_render_back_through_the_template(tool_server):
    reply = await in_thread(lambda: forced(tool_server, "hermes", tool_choice="required", parallel_tool_calls=False))
    call = reply.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    again = await in_thread(lambda: openai_client(tool_server).chat.completions.create(
        model="tiny-hermes", messages=history, tools=[WEATHER, TIME], max_tokens=4, temperature=0))
    # The history with its call and result is a longer prompt than the question alone.
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens + len('{"temperature": 21}')


@pytest.mark.parametrize("body, says", [
    ({"tools": [{"type": "function"}]}, "each tool must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
])
async def test_openai_bad_tools_are_400(tool_server, body, says):
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{tool_server}/v1/chat/completions", json={"model": "tiny-hermes", "messages": ASK, **body})
    assert response.status_code == 400
    assert says in response.json()["error"]["message"]


async def test_a_template_without_tools_is_400_in_both_apis(tool_server):
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        await in_thread(lambda: forced(tool_server, "notools", tool_choice="required"))
    with pytest.raises(ollama.ResponseError, match="does not support tools"):
        await in_thread(lambda: ollama.Client(host=tool_server).chat(model="tiny-notools", messages=ASK, tools=[WEATHER]))


# --- Ollama: the Llama 3 family's bare JSON call, made by a `format` schema ------------------------------

LLAMA_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}


def ollama_chat(server: str, **kwargs):
    return ollama.Client(host=server).chat(model="tiny-llama3", messages=ASK, tools=[WEATHER], format=LLAMA_CALL,
                                           options={"temperature": 0, "num_predict": 200}, **kwargs)


async def test_ollama_chat_returns_the_parsed_call(tool_server):
    reply = await in_thread(lambda: ollama_chat(tool_server))
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments["city"] in CITY["enum"]
    assert reply.message.content == ""
    assert reply.done_reason == "stop"


async def test_ollama_stream_sends_the_call_in_one_chunk_when_complete(tool_server):
    parts = await in_thread(lambda: list(ollama_chat(tool_server, stream=True)))
    with_calls = [part for part in parts if part.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done
    assert with_calls[0].message.tool_calls[0].function.name == "get_weather"
    assert "".join(part.message.content for part in parts) == ""
    assert parts[-1].done


async def test_ollama_tool_results_render_back(tool_server):
    reply = await in_thread(lambda: ollama_chat(tool_server))
    history = ASK + [reply.message.model_dump(exclude_none=True), {"role": "tool", "tool_name": "get_weather", "content": "21 degrees"}]
    again = await in_thread(lambda: ollama.Client(host=tool_server).chat(
        model="tiny-llama3", messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 2}))
    assert again.prompt_eval_count > reply.prompt_eval_count + len("21 degrees")


async def test_openai_auto_mode_answers_in_text_when_no_call_opens(tool_server):
    reply = await in_thread(lambda: forced(tool_server, "hermes", max_tokens=6))
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
