"""One decode path: `load_model().generate()`, `corral run` in-process and the server all answer through
the runtime, so stop strings, `format` and a Modelfile's defaults behave the same everywhere."""

import json

import pytest
import trio

from corral.runner.runtime import Runtime

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"
CAPITAL_SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}


@pytest.fixture
def smollm2(smollm2_path, load_once):
    return load_once(smollm2_path)


def generated(model, prompt, **kwargs) -> str:
    return "".join(model.generate(prompt, **kwargs))


async def test_generate_answers_as_the_runtime_does_greedily(smollm2):
    prompt = "Why is the sky blue?"
    blocking = await trio.to_thread.run_sync(lambda: generated(smollm2, prompt, max_tokens=32, temperature=0))
    async with Runtime.open(smollm2, num_parallel=2, num_ctx=4096) as rt:
        async with rt.generate(prompt, {"temperature": 0, "num_predict": 32}) as stream:
            text, final = await stream.collect()
    assert final.eval_count == 32
    assert blocking == text


def test_generate_stops_before_a_stop_string(smollm2):
    answer = generated(smollm2, QUESTION, max_tokens=24)
    assert "Paris" in answer
    stopped = generated(smollm2, QUESTION, max_tokens=24, options={"stop": ["Paris"]})
    assert stopped == answer[: answer.index("Paris")]


def test_generate_honours_the_runtimes_sampler_options(smollm2):
    # top_k 1 is greedy whatever the temperature: the sampler chain, not a loop of its own, draws.
    greedy = generated(smollm2, QUESTION, max_tokens=16, temperature=0)
    assert generated(smollm2, QUESTION, max_tokens=16, temperature=1.5, seed=3, options={"top_k": 1}) == greedy


def test_generate_with_a_json_schema_answers_that_json(smollm2):
    answer = generated(smollm2, QUESTION + " Answer in JSON.", max_tokens=48, format=CAPITAL_SCHEMA)
    assert isinstance(json.loads(answer)["capital"], str)
