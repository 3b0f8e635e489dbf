"""Honest refusals and the sampling extras on a live server, through the official `ollama` and `openai` clients.

Images sent to a model that cannot see, fields corral does not do, a suffix for a template without one: each a
400 naming what was refused. The samplers' options (OpenAI's logit_bias, vLLM's and llama.cpp's extras) are taken
on the OpenAI routes and change the output; a wrong type or range is a 400. Run on the tiny synthetic store.
"""

from __future__ import annotations

import base64

import httpx
import ollama
import openai
import pytest
import trio
from conftest import TINY_LLAMA

PIXEL = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
HI = [{"role": "user", "content": "Hi"}]
FIM_TEMPLATE = "<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>"


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="corral", max_retries=0)


async def post(server, path: str, **body) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        return await http.post(path, json=body)


def ollama_error(fn) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as raised:
        fn()
    return raised.value


def openai_error(fn) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        fn()
    return raised.value


# -- images ----------------------------------------------------------------------------------------


async def test_ollama_images_for_a_model_without_vision_are_refused(tiny_server):
    client = ollama.Client(host=tiny_server)
    generate = await in_thread(ollama_error, lambda: client.generate(TINY_LLAMA, "Describe it", images=[PIXEL]))
    chat = await in_thread(ollama_error, lambda: client.chat(TINY_LLAMA, [{"role": "user", "content": "Describe it", "images": [PIXEL]}]))
    for error in (generate, chat):
        assert error.status_code == 400 and f'"{TINY_LLAMA}" does not support images' in error.error


async def test_ollama_images_alone_are_refused_rather_than_loading_the_model(tiny_server):
    response = await post(tiny_server, "/api/generate", model=TINY_LLAMA, images=[PIXEL])
    assert response.status_code == 400 and "does not support images" in response.json()["error"]


async def test_openai_image_parts_for_a_model_without_vision_are_refused(tiny_server):
    parts = [{"type": "text", "text": "Describe it"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}]
    error = await in_thread(
        openai_error, lambda: oai(tiny_server).chat.completions.create(model=TINY_LLAMA, messages=[{"role": "user", "content": parts}])
    )
    assert error.status_code == 400 and f'"{TINY_LLAMA}" does not support images' in error.message


async def test_openai_audio_parts_are_refused_naming_the_part(tiny_server):
    parts = [{"type": "input_audio", "input_audio": {"data": PIXEL, "format": "wav"}}]
    response = await post(tiny_server, "/v1/chat/completions", model=TINY_LLAMA, messages=[{"role": "user", "content": parts}])
    assert response.status_code == 400 and "'input_audio' are not supported" in response.json()["error"]["message"]


# -- fields corral does not do ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}, "audio is not supported"),
        ("modalities", ["text", "audio"], "modalities is not supported"),
        ("prediction", {"type": "content", "content": "x"}, "prediction is not supported"),
        ("min_tokens", 5, "min_tokens is not supported"),
        ("stop_token_ids", [2], "stop_token_ids is not supported"),
        ("use_beam_search", True, "use_beam_search is not supported"),
        ("guided_regex", "a+", "guided_regex is not supported"),
    ],
)
async def test_openai_fields_corral_does_not_do_are_refused(tiny_server, field, value, says):
    response = await post(tiny_server, "/v1/chat/completions", model=TINY_LLAMA, messages=HI, max_tokens=2, **{field: value})
    assert response.status_code == 400 and says in response.json()["error"]["message"]


async def test_openai_harmless_values_of_those_fields_pass(tiny_server):
    response = await post(
        tiny_server, "/v1/chat/completions", model=TINY_LLAMA, messages=HI, max_tokens=2, modalities=["text"], min_tokens=0
    )
    assert response.status_code == 200


async def test_ollama_truncate_false_is_refused(tiny_server):
    response = await post(tiny_server, "/api/generate", model=TINY_LLAMA, prompt="Hi", truncate=False, stream=False)
    assert response.status_code == 400 and "truncate is not supported" in response.json()["error"]


# -- suffix ----------------------------------------------------------------------------------------


async def test_openai_suffix_without_a_fill_in_the_middle_template_is_refused(tiny_server):
    error = await in_thread(openai_error, lambda: oai(tiny_server).completions.create(model=TINY_LLAMA, prompt="def f(", suffix="return x"))
    assert error.status_code == 400 and f"{TINY_LLAMA} does not support insert" in error.message


async def test_openai_suffix_fills_in_the_middle_through_the_template(tiny_server):
    client = ollama.Client(host=tiny_server)
    await in_thread(lambda: client.create("fim", from_=TINY_LLAMA, template=FIM_TEMPLATE))
    reply = await in_thread(
        lambda: oai(tiny_server).completions.create(model="fim", prompt="def f(", suffix="return x", max_tokens=4, temperature=0)
    )
    rendered = "<PRE> def f( <SUF>return x <MID>"
    tokens = (await post(tiny_server, "/api/tokenize", model="fim", content=rendered, add_special=False)).json()["tokens"]
    assert reply.usage.prompt_tokens == len(tokens)
    options = {"temperature": 0, "num_predict": 4}
    ollama_reply = await in_thread(lambda: client.generate("fim", "def f(", suffix="return x", options=options))
    assert reply.choices[0].text == ollama_reply.response


# -- sampling extras on the OpenAI routes ----------------------------------------------------------


async def test_openai_logit_bias_steers_the_tokens(tiny_server):
    chosen = 100
    reply = await in_thread(
        lambda: oai(tiny_server).completions.create(
            model=TINY_LLAMA, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(chosen): 100}
        )
    )
    expected = (await post(tiny_server, "/api/detokenize", model=TINY_LLAMA, tokens=[chosen] * 3)).json()["content"]
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 3


async def test_openai_vllm_extras_are_taken(tiny_server):
    def ask(**extra):
        return oai(tiny_server).chat.completions.create(
            model=TINY_LLAMA, messages=HI, max_tokens=6, temperature=1.5, seed=3, extra_body=extra
        )

    greedy = await in_thread(lambda: oai(tiny_server).chat.completions.create(model=TINY_LLAMA, messages=HI, max_tokens=6, temperature=0))
    # top_k 1 leaves one candidate: hot sampling gives the greedy text.
    top1 = await in_thread(lambda: ask(top_k=1))
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    for extra in ({"top_k": -1, "min_p": 0.1}, {"repetition_penalty": 1.3}, {"repeat_penalty": 1.2, "typical_p": 0.9},
                  {"mirostat": 2, "mirostat_tau": 3.0}, {"dry_multiplier": 0.8}, {"xtc_probability": 0.5}):  # fmt: skip
        reply = await in_thread(lambda: ask(**extra))
        assert reply.usage.completion_tokens > 0, extra


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"top_k": "many"}, "option 'top_k' must be an integer"),
        ({"min_p": 1.5}, "option 'min_p' must be >= 0.0 and <= 1.0"),
        ({"mirostat": 3}, "option 'mirostat' must be >= 0 and <= 2"),
        ({"logit_bias": {"1": 500}}, "option 'logit_bias' must be an object mapping token ids to biases from -100 to 100"),
        ({"logit_bias": {"999999": 1}}, "logit_bias has token ids outside the vocabulary"),
        ({"dry_base": 0.2}, "option 'dry_base' must be >= 1.0"),
        ({"xtc_threshold": 2}, "option 'xtc_threshold' must be >= 0.0 and <= 1.0"),
    ],
)
async def test_openai_wrong_sampler_values_are_400(tiny_server, extra, says):
    response = await post(tiny_server, "/v1/chat/completions", model=TINY_LLAMA, messages=HI, max_tokens=2, **extra)
    assert response.status_code == 400 and says in response.json()["error"]["message"]


async def test_ollama_sampler_options_are_taken_and_checked(tiny_server):
    client = ollama.Client(host=tiny_server)
    options = {"mirostat": 1, "mirostat_eta": 0.2, "dry_multiplier": 0.5, "logit_bias": {"5": -100}, "seed": 1, "num_predict": 4}
    reply = await in_thread(lambda: client.generate(TINY_LLAMA, "Hi", options=options))
    assert reply.eval_count > 0
    error = await in_thread(ollama_error, lambda: client.generate(TINY_LLAMA, "Hi", options={"xtc_probability": -1}))
    assert error.status_code == 400 and "option 'xtc_probability' must be >= 0.0" in error.error


# -- /openapi.json ---------------------------------------------------------------------------------


async def test_openapi_describes_the_sampler_options_and_extras_and_not_the_refused_fields(tiny_server):
    from corral.registry import Plugins
    from corral.sample import SamplerChain
    from corral.server.openai import PASSED_OPTIONS, UNSUPPORTED

    async with httpx.AsyncClient(base_url=tiny_server) as http:
        schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
    declared = set(SamplerChain(Plugins()).fields)
    assert declared <= set(schemas["Options"]["properties"])
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        fields = schemas[request]["properties"]
        assert set(PASSED_OPTIONS) | {"repetition_penalty", "logit_bias"} <= set(fields)
        refused = {name for name, (harmless, _) in UNSUPPORTED.items() if harmless is None}
        assert not refused & set(fields), refused & set(fields)
    assert schemas["GenerateRequest"]["properties"]["truncate"]["const"] is True
