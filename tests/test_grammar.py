"""Constrained decoding: `format` ("json" or a JSON schema) on the runtime and on both HTTP APIs, with smollm2."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest
import torch
import trio

from corral.grammar import GrammarMatcher, InvalidFormatError, compile_format, mask_logits
from corral.runner.runtime import Runtime

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("runtime_loads_once")]

PERSON = {
    "type": "object",
    # Bounded, so that even hot sampling must close the object within NUM_PREDICT tokens.
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,  # else a small model may add keys until num_predict
}
ALICE = 'Give the JSON for Alice, who is 30 years old, with keys "name" and "age".'
NUM_PREDICT = 48

async def complete(rt: Runtime, prompt: str, options: dict, **kwargs):
    async with rt.generate(prompt, options, **kwargs) as stream:
        return await stream.collect()


def assert_person(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and {"name", "age"} <= value.keys()
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


# -- the runtime -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 1.0, "seed": 2}, {"temperature": 1.0, "seed": 3}])
async def test_json_format_output_is_one_json_object_ending_by_itself(smollm2_path, options):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        text, final = await complete(rt, ALICE, {**options, "num_predict": NUM_PREDICT}, format="json")
    assert isinstance(json.loads(text), dict)
    assert final.done_reason == "stop" and final.eval_count < NUM_PREDICT


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 1.5, "seed": 4}])
async def test_schema_format_output_validates_and_ends_by_itself(smollm2_path, options):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        text, final = await complete(rt, "Invent a person.", {**options, "num_predict": NUM_PREDICT}, format=PERSON)
    assert_person(text)
    assert final.done_reason == "stop" and final.eval_count < NUM_PREDICT


async def test_chat_follows_the_format(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        async with rt.chat([{"role": "user", "content": ALICE}], {"temperature": 0}, format=PERSON) as stream:
            text, final = await stream.collect()
    assert json.loads(text) == {"name": "Alice", "age": 30}
    assert final.done_reason == "stop"


async def test_a_constrained_row_leaves_the_other_rows_of_its_batch_unchanged(smollm2_path):
    requests = [
        ("Invent a person.", {"temperature": 0, "num_predict": NUM_PREDICT}, PERSON),
        ("The capital of France is", {"temperature": 0.8, "seed": 5, "num_predict": 24}, None),
    ]
    alone, alone_steps = [], 0
    for prompt, opts, fmt in requests:  # each in a fresh runtime: no prefix reused from the one before
        async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
            alone.append((await complete(rt, prompt, opts, raw=True, format=fmt))[0])
            alone_steps += rt.batcher.stats.steps
    together = [""] * len(requests)
    async with Runtime.open(smollm2_path, num_parallel=2, num_ctx=256) as rt:

        async def run(i):
            prompt, opts, fmt = requests[i]
            together[i] = (await complete(rt, prompt, opts, raw=True, format=fmt))[0]

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(run, i)
        together_steps = rt.batcher.stats.steps
    assert together_steps < alone_steps, "the two requests should have shared steps"
    assert_person(together[0])
    assert together == alone


@pytest.mark.parametrize(
    "format, says",
    [
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}, "missing"),
        ("yaml", 'format must be "json" or a JSON schema object'),
        (42, 'format must be "json" or a JSON schema object'),
    ],
)
def test_unusable_formats_are_typed_errors(format, says):
    with pytest.raises(InvalidFormatError, match=says):
        compile_format(format)


async def test_runtime_refuses_an_unusable_schema_before_generating(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        with pytest.raises(InvalidFormatError):
            rt.generate("Hi", {}, format={"type": "nonsense"})
        assert rt.status().live_sequences == 0


async def test_grammar_is_the_first_sampler_step(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        assert rt.chain.steps[0][0] == "grammar"


async def test_mask_allows_only_grammar_tokens_and_no_padding_column(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        tokenizer = rt.model.tokenizer
        matchers = [GrammarMatcher.start(tokenizer, compile_format("json")) for _ in range(2)]
    vocab = tokenizer.vocab_size
    logits = mask_logits(torch.zeros(2, vocab + 64), matchers)  # a model padded past the vocabulary
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(token < vocab and tokenizer.token_bytes(token).startswith(b"{") for token in allowed)
    assert torch.equal(logits[0], logits[1])


# -- HTTP ------------------------------------------------------------------------------------------


async def test_ollama_generate_and_chat_follow_format(server):
    def run():
        client = ollama.Client(host=server)
        generated = client.generate(model="smollm2", prompt=ALICE, format="json", options={"temperature": 0, "num_predict": NUM_PREDICT})
        chatted = client.chat(
            model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], format=PERSON,
            options={"temperature": 0, "num_predict": NUM_PREDICT},
        )
        return generated, chatted

    generated, chatted = await trio.to_thread.run_sync(run)
    assert isinstance(json.loads(generated.response), dict) and generated.done_reason == "stop"
    assert_person(chatted.message.content)
    assert chatted.done_reason == "stop"


async def test_openai_response_format_json_object_and_json_schema(server):
    def run():
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="corral", max_retries=0)
        messages = [{"role": "user", "content": ALICE}]
        as_object = client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=NUM_PREDICT, response_format={"type": "json_object"}
        )
        as_schema = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], temperature=0, max_tokens=NUM_PREDICT,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        return as_object, as_schema

    as_object, as_schema = await trio.to_thread.run_sync(run)
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    assert_person(as_schema.choices[0].message.content)
    assert as_object.choices[0].finish_reason == as_schema.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/generate", {"model": "smollm2", "prompt": "Hi", "format": "yaml"}),
        ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "format": {"type": "nonsense"}}),
        (
            "/v1/chat/completions",
            {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        ),
    ],
)
async def test_unusable_formats_are_400(server, path, body):
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 400
    assert "format" in json.dumps(response.json())
