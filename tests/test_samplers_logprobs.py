"""Ollama's `logprobs` / `top_logprobs` over HTTP, through the official `ollama` client, on the tiny store."""

from __future__ import annotations

import math

import httpx
import ollama
import pytest
import trio
from conftest import TINY_LLAMA

GREEDY = {"temperature": 0, "num_predict": 6, "ignore_eos": True}


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


def check(logprobs, top: int) -> None:
    """Each token: a logprob <= 0, `top` alternatives best first, the greedy choice the best of them."""
    for entry in logprobs:
        assert entry.logprob <= 0
        alternatives = [alt.logprob for alt in entry.top_logprobs or []]
        assert len(alternatives) == top and alternatives == sorted(alternatives, reverse=True)
        assert sum(math.exp(value) for value in alternatives) <= 1 + 1e-5
        if top:
            assert entry.logprob == pytest.approx(alternatives[0], abs=1e-5)  # greedy: the chosen token is the best


async def test_generate_returns_one_logprob_per_token_with_its_alternatives(tiny_server):
    client = ollama.Client(host=tiny_server)
    reply = await in_thread(lambda: client.generate(TINY_LLAMA, "Hi", options=GREEDY, logprobs=True, top_logprobs=3))
    assert len(reply.logprobs) == reply.eval_count == 6
    assert "".join(entry.token for entry in reply.logprobs) == reply.response
    check(reply.logprobs, 3)


async def test_streamed_chat_logprobs_match_the_whole_reply(tiny_server):
    client = ollama.Client(host=tiny_server)
    messages = [{"role": "user", "content": "Hi"}]
    whole = await in_thread(lambda: client.chat(TINY_LLAMA, messages, options=GREEDY, logprobs=True, top_logprobs=2))
    parts = await in_thread(lambda: list(client.chat(TINY_LLAMA, messages, options=GREEDY, logprobs=True, top_logprobs=2, stream=True)))
    streamed = [entry for part in parts for entry in part.logprobs or []]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs]
    # The second request reuses the first's cached prompt: the same tokens, logprobs within bf16 rounding.
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs], abs=0.02)
    assert len(whole.logprobs) == whole.eval_count
    check(whole.logprobs, 2)


async def test_without_logprobs_none_are_sent(tiny_server):
    client = ollama.Client(host=tiny_server)
    reply = await in_thread(lambda: client.generate(TINY_LLAMA, "Hi", options=GREEDY))
    assert reply.logprobs is None


@pytest.mark.parametrize("top", [21, -1])
async def test_top_logprobs_out_of_range_is_400(tiny_server, top):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        response = await http.post("/api/generate", json={"model": TINY_LLAMA, "prompt": "Hi", "logprobs": True, "top_logprobs": top})
    assert response.status_code == 400 and "top_logprobs must be an integer from 0 to 20" in response.json()["error"]
