"""The Ollama API on a live server, driven by the official `ollama` client and raw HTTP.

What only exercises routing (listing, show, copy/delete, errors, load and unload) runs against the tiny
synthetic store (`tiny_server`); what checks generated text runs on the real models (`server`).
"""

import json

import httpx
import ollama
import pytest
import trio
from conftest import TINY_GEMMA3, TINY_LLAMA

GREEDY = {"temperature": 0, "num_predict": 12}


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


def client(server) -> ollama.Client:
    return ollama.Client(host=server)


async def test_list_shows_the_store_models(tiny_server):
    names = {m.model for m in (await in_thread(client(tiny_server).list)).models}
    assert names == {TINY_LLAMA, TINY_GEMMA3}


async def test_show_reports_details_and_gguf_metadata(tiny_server):
    shown = await in_thread(client(tiny_server).show, TINY_LLAMA)
    assert shown.details.family == "llama"
    assert shown.details.quantization_level == "Q4_0"
    # token_embd 262 x 64 + output_norm 64 + 2 blocks of (q 64x64, k and v 32x64, o 64x64, gate/up/down 128x64, two norms of 64)
    assert shown.details.parameter_size == "90.82K"
    assert shown.modelinfo["llama.context_length"] == 128
    assert "completion" in shown.capabilities
    assert "<|im_start|>" in shown.template


async def test_generate_not_streaming_returns_text_and_metrics(server):
    result = await in_thread(
        lambda: client(server).generate(model="smollm2", prompt="What is the capital of France?", options=GREEDY)
    )
    assert "Paris" in result.response
    assert result.done and result.done_reason in ("stop", "length")
    assert result.eval_count > 0 and result.prompt_eval_count > 0
    assert result.total_duration >= result.eval_duration > 0
    assert result.context and all(isinstance(t, int) for t in result.context)


async def test_generate_streaming_chunks_join_to_the_generated_tokens(server):
    parts = await in_thread(
        lambda: list(client(server).generate(model="smollm2", prompt="Name a colour.", options=GREEDY, stream=True))
    )
    final = parts[-1]
    assert [part.done for part in parts].count(True) == 1 and final.done
    generated = final.context[final.prompt_eval_count :]
    assert len(generated) == final.eval_count
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        text = (await http.post("/api/detokenize", json={"model": "smollm2", "tokens": generated})).json()["content"]
    assert "".join(part.response for part in parts) == text


async def test_chat_streaming_and_not(server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def run():
        c = client(server)
        parts = list(c.chat(model="smollm2", messages=messages, options=GREEDY, stream=True))
        return parts, c.chat(model="smollm2", messages=messages, options=GREEDY)

    parts, whole = await in_thread(run)
    assert "Paris" in whole.message.content and whole.message.role == "assistant"
    assert "Paris" in "".join(p.message.content for p in parts)
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")


async def test_ndjson_framing_byte_level(server):
    body = {"model": "smollm2", "prompt": "Hi", "options": {"temperature": 0, "num_predict": 4}}
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        response = await http.post("/api/generate", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    raw = response.content
    assert raw.endswith(b"\n")
    lines = [json.loads(line) for line in raw.split(b"\n")[:-1]]
    assert all(not line["done"] for line in lines[:-1])
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "length" and final["eval_count"] == 4
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration", "prompt_eval_count"):
        assert isinstance(final[key], int), key
    assert final["created_at"].endswith("Z") and isinstance(final["context"], list)


async def test_ps_lists_a_loaded_model_and_keep_alive_zero_unloads_it(tiny_server):
    def run():
        c = client(tiny_server)
        c.generate(model=TINY_LLAMA, prompt="Hi", options={"num_predict": 1})
        loaded = [m.model for m in c.ps().models]
        c.generate(model=TINY_LLAMA, prompt="Hi", options={"num_predict": 1}, keep_alive=0)
        return loaded, [m.model for m in c.ps().models]

    loaded, after = await in_thread(run)
    assert loaded == [TINY_LLAMA]
    assert after == []


async def test_empty_prompt_loads_and_keep_alive_zero_unloads(tiny_server):
    def run():
        c = client(tiny_server)
        loaded = c.generate(model=TINY_LLAMA, prompt="")
        ps_after_load = [m.model for m in c.ps().models]
        unloaded = c.generate(model=TINY_LLAMA, prompt="", keep_alive=0)
        return loaded, ps_after_load, unloaded, [m.model for m in c.ps().models]

    loaded, ps_after_load, unloaded, ps_after_unload = await in_thread(run)
    assert loaded.done_reason == "load" and ps_after_load == [TINY_LLAMA]
    assert unloaded.done_reason == "unload" and ps_after_unload == []


async def test_copy_then_delete(tiny_server):
    def run():
        c = client(tiny_server)
        c.copy(TINY_LLAMA, "my-copy:v1")
        names = {m.model for m in c.list().models}
        c.delete("my-copy:v1")
        return names, {m.model for m in c.list().models}, c.show(TINY_LLAMA).details.family

    with_copy, after_delete, family = await in_thread(run)
    assert "my-copy:v1" in with_copy and "my-copy:v1" not in after_delete
    assert family == "llama"  # the shared blob survived the delete


async def test_pull_of_a_present_model_streams_progress_to_success(server):
    statuses = await in_thread(lambda: [p.status for p in client(server).pull("smollm2", stream=True)])
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"


async def test_version(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server) as http:
        response = await http.get("/api/version")
    assert response.status_code == 200 and response.json()["version"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("post", "/api/generate", {"model": "no-such-model", "prompt": "hi"}, 404, "model 'no-such-model' not found"),
        ("post", "/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model is required"),
        ("post", "/api/generate", b"{not json", 400, "invalid JSON"),
        ("post", "/api/generate", None, 400, "missing request body"),
        ("get", "/api/generate", None, 405, None),
        ("post", "/api/generate", {"model": TINY_LLAMA, "prompt": "x", "raw": True, "system": "s"}, 400, "raw mode"),
        ("post", "/api/generate", {"model": TINY_LLAMA, "prompt": "x", "options": {"temperature": "hot"}}, 400, "temperature"),
        ("post", "/api/generate", {"model": TINY_LLAMA, "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive"),
        ("post", "/api/show", {"model": "../../etc/passwd"}, 400, None),
        ("post", "/api/embed", {"model": TINY_LLAMA, "input": "hi"}, 400, "does not support embeddings"),
    ],
)
async def test_errors_have_status_and_message(tiny_server, method, path, body, status, message):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        if isinstance(body, bytes):
            response = await http.request(method, path, content=body)
        else:
            response = await http.request(method, path, json=body)
    assert response.status_code == status
    assert "error" in response.json()
    if message:
        assert message in response.json()["error"]


async def test_client_disconnect_mid_stream_leaves_the_server_serving(tiny_server):
    body = {"model": TINY_LLAMA, "prompt": "Tell me a long story.", "options": {"num_predict": 200}}
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        async with http.stream("POST", "/api/generate", json=body) as response:
            async for _ in response.aiter_lines():
                break  # hang up after the first chunk
        again = await http.post("/api/generate", json={"model": TINY_LLAMA, "prompt": "Hi", "stream": False, "options": GREEDY})
    assert again.status_code == 200 and again.json()["done"]


async def test_tools_on_a_model_without_tool_support_is_a_400(tiny_server):
    tool = {"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": TINY_GEMMA3, "messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "stream": False}
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        response = await http.post("/api/chat", json=body)
        capabilities = (await http.post("/api/show", json={"model": TINY_GEMMA3})).json()["capabilities"]
    assert "tools" not in capabilities
    assert response.status_code == 400 and "does not support tools" in response.json()["error"]
