"""The OpenAI API on a live server, driven by the official `openai` client and raw HTTP.

What only exercises routing (models, errors) runs against the tiny synthetic store (`tiny_server`);
what checks generated text runs on the real models (`server`).
"""

import json

import httpx
import openai
import pytest
import trio
from conftest import TINY_GEMMA3, TINY_LLAMA

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="corral", max_retries=0)


async def post(server, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        return await http.post(path, **kwargs)


def sse_events(raw: bytes) -> list[str]:
    """The data of each event, after checking that every event is exactly `data: <payload>\\n\\n`."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    return [event.removeprefix("data: ") for event in events]


def assert_openai_error(response: httpx.Response, status: int, says: str) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"]


async def test_chat_completion_answers_with_usage(server):
    reply = await in_thread(
        lambda: client(server).chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=20)
    )
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == "smollm2" and reply.system_fingerprint == "fp_corral"
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = reply.usage
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 20
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_chat_text_parts_are_joined(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    reply = await in_thread(
        lambda: client(server).chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20)
    )
    assert "Paris" in reply.choices[0].message.content


async def test_chat_streaming_with_usage_matches_the_whole_reply(server):
    def run():
        c = client(server)
        kwargs = {"model": "smollm2", "messages": FRANCE, "temperature": 0, "max_tokens": 12}
        chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        return chunks, c.chat.completions.create(**kwargs)

    chunks, whole = await in_thread(run)
    *content, finish, usage = chunks
    assert content[0].choices[0].delta.role == "assistant" and content[0].choices[0].delta.content == ""
    assert all(chunk.object == "chat.completion.chunk" and chunk.usage is None for chunk in content + [finish])
    assert "".join(chunk.choices[0].delta.content for chunk in content) == whole.choices[0].message.content
    assert all(chunk.choices[0].finish_reason is None for chunk in content)
    assert finish.choices[0].delta.content is None and finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens


async def test_chat_stream_is_framed_as_server_sent_events(server):
    body = {"model": "smollm2", "messages": FRANCE, "temperature": 0, "max_tokens": 6, "stream": True}
    response = await post(server, "/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *events, done = sse_events(response.content)
    assert done == "[DONE]"
    chunks = [json.loads(event) for event in events]
    assert len({(chunk["id"], chunk["created"]) for chunk in chunks}) == 1
    assert all("usage" not in chunk for chunk in chunks)  # include_usage not asked for
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


async def test_max_tokens_ends_with_length(server):
    reply = await in_thread(
        lambda: client(server).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=5
        )
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


async def test_stop_sequence_ends_the_reply_before_it(server):
    def run():
        c = client(server)
        kwargs = {"model": "smollm2", "messages": FRANCE, "temperature": 0, "max_tokens": 20}
        return c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs, stop=["Paris"])

    free, stopped = await in_thread(run)
    text = free.choices[0].message.content
    assert "Paris" in text
    assert stopped.choices[0].message.content == text[: text.index("Paris")]
    assert stopped.choices[0].finish_reason == "stop"


async def test_chat_logprobs_with_top_alternatives(server):
    reply = await in_thread(
        lambda: client(server).chat.completions.create(
            model="smollm2", messages=FRANCE, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
        )
    )
    choice = reply.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == reply.usage.completion_tokens == 4
    assert "".join(t.token for t in tokens) == choice.message.content
    for token in tokens:
        assert token.logprob <= 0 and bytes(token.bytes).decode() == token.token
        assert len(token.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)


async def test_completion_continues_the_raw_prompt(server):
    def run():
        c = client(server)
        kwargs = {"model": "smollm2", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
        streamed = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        return streamed, c.completions.create(**kwargs)

    streamed, whole = await in_thread(run)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert "Paris" in whole.choices[0].text
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    *texts, finish, usage = streamed
    assert "".join(chunk.choices[0].text for chunk in texts) == whole.choices[0].text
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].text == ""
    assert usage.choices == [] and usage.usage.completion_tokens == 8


async def test_completion_max_tokens_defaults_to_16(server):
    reply = await in_thread(
        lambda: client(server).completions.create(model="smollm2", prompt="Once upon a time", temperature=0)
    )
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


async def test_completion_logprobs_are_parallel_lists(server):
    reply = await in_thread(
        lambda: client(server).completions.create(
            model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2
        )
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]


async def test_models_list_and_retrieve(tiny_server):
    def run():
        c = client(tiny_server)
        listed = c.models.list().data
        return listed, c.models.retrieve(TINY_GEMMA3)

    listed, one = await in_thread(run)
    ids = {model.id for model in listed}
    assert {TINY_LLAMA, TINY_GEMMA3} == ids
    assert all(model.object == "model" and model.owned_by == "library" and model.created > 1_600_000_000 for model in listed)
    assert one.id == TINY_GEMMA3 and one.created == next(m.created for m in listed if m.id == TINY_GEMMA3)


async def test_retrieve_unknown_model_is_404(tiny_server):
    with pytest.raises(openai.NotFoundError):
        await in_thread(lambda: client(tiny_server).models.retrieve("no-such-model"))
    async with httpx.AsyncClient(base_url=tiny_server) as http:
        assert_openai_error(await http.get("/v1/models/library/no-such:model"), 404, "not found")


async def test_embeddings_are_not_supported_yet(tiny_server):
    with pytest.raises(openai.BadRequestError, match="does not support embeddings"):
        await in_thread(lambda: client(tiny_server).embeddings.create(model=TINY_LLAMA, input="hello"))


async def test_unknown_model_is_404(tiny_server):
    for call in (
        lambda: client(tiny_server).chat.completions.create(model="no-such-model", messages=FRANCE),
        lambda: client(tiny_server).completions.create(model="no-such-model", prompt="hi"),
        lambda: client(tiny_server).embeddings.create(model="no-such-model", input="hi"),
    ):
        with pytest.raises(openai.NotFoundError, match="not found"):
            await in_thread(call)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": FRANCE}, "model is required"),
        ({"model": TINY_LLAMA, "messages": FRANCE, "temperature": "hot"}, "temperature must be of type"),
        ({"model": TINY_LLAMA, "messages": FRANCE, "temperature": 3}, "temperature must be between 0 and 2"),
        ({"model": TINY_LLAMA, "messages": FRANCE, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"model": TINY_LLAMA, "messages": FRANCE, "stop": [1]}, "stop must be"),
        ({"model": TINY_LLAMA, "messages": []}, "at least one message"),
        ({"model": TINY_LLAMA, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "does not support images"),
        ({"model": TINY_LLAMA, "messages": FRANCE, "response_format": {"type": "xml"}}, "response_format.type must be"),
    ],
)
async def test_invalid_chat_requests_are_400(tiny_server, body, says):
    assert_openai_error(await post(tiny_server, "/v1/chat/completions", json=body), 400, says)


async def test_malformed_requests_are_openai_errors(tiny_server):
    assert_openai_error(await post(tiny_server, "/v1/chat/completions", content=b"{not json"), 400, "invalid JSON")
    assert_openai_error(await post(tiny_server, "/v1/completions", json={"model": TINY_LLAMA, "prompt": ["a", "b"]}), 400, "prompt")
    async with httpx.AsyncClient(base_url=tiny_server) as http:
        assert_openai_error(await http.get("/v1/chat/completions"), 405, "method")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await in_thread(
            lambda: client(tiny_server).chat.completions.create(model=TINY_LLAMA, messages=FRANCE, temperature="warm")
        )


async def test_error_after_streaming_began_is_a_final_error_event(tiny_server, monkeypatch):
    from corral.runner.sequence import SequenceActor

    def broken(self):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(SequenceActor, "_final_chunk", broken)
    body = {"model": TINY_LLAMA, "messages": FRANCE, "temperature": 0, "max_tokens": 3, "stream": True}
    response = await post(tiny_server, "/v1/chat/completions", json=body)
    assert response.status_code == 200
    *events, error, done = sse_events(response.content)
    assert done == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(error) == {
        "error": {"message": "internal error: the device fell over", "type": "server_error", "param": None, "code": None}
    }
    with pytest.raises(openai.APIError, match="the device fell over"):
        await in_thread(lambda: list(client(tiny_server).chat.completions.create(**body)))
