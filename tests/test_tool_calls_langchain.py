"""Tool calls through LangChain's `langchain-openai` and `langchain-ollama`, as agent frameworks make them,
against the same live server of tiny models with real templates as test_tool_calls_server."""

from __future__ import annotations

import pytest
import trio
import test_tool_calls_server as shared
from test_tool_calls_server import ASK, CITY, LLAMA_CALL, TIME, WEATHER

pytestmark = [pytest.mark.slow, pytest.mark.peers]  # a server driven through LangChain, over llama.cpp's templates: out of the fast subset


# The same fixtures: a store of tiny models with real templates, and a live server over a copy of it.
tool_store_root = shared.tool_store_root
tool_server = shared.tool_server


async def in_thread(fn):
    return await trio.to_thread.run_sync(fn)


async def test_langchain_openai_bind_tools_with_a_forced_call(langchain_openai, tool_server):
    chat = langchain_openai.ChatOpenAI(base_url=f"{tool_server}/v1", api_key="unused", model="tiny-hermes", temperature=0,
                                       max_tokens=200, max_retries=0)
    bound = chat.bind_tools([WEATHER, TIME], tool_choice="get_time", parallel_tool_calls=False)
    reply = await in_thread(lambda: bound.invoke(ASK[0]["content"]))
    (call,) = reply.tool_calls
    assert call["name"] == "get_time" and call["args"]["city"] in CITY["enum"] and call["id"].startswith("call_")


async def test_langchain_openai_streams_a_call(langchain_openai, tool_server):
    chat = langchain_openai.ChatOpenAI(base_url=f"{tool_server}/v1", api_key="unused", model="tiny-mistral", temperature=0,
                                       max_tokens=200, max_retries=0)
    bound = chat.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False)
    chunks = await in_thread(lambda: list(bound.stream(ASK[0]["content"])))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITY["enum"]


async def test_langchain_ollama_returns_the_parsed_call(langchain_ollama, tool_server):
    chat = langchain_ollama.ChatOllama(base_url=tool_server, model="tiny-llama3", temperature=0, num_predict=200, format=LLAMA_CALL)
    reply = await in_thread(lambda: chat.bind_tools([WEATHER]).invoke(ASK[0]["content"]))
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITY["enum"]
