"""Images through the Runtime: split at their tags, encoded (once per image), fed whole in one pass, counted
in the context, on the tiny Gemma 3 vision model of vision_driver.py (marker `peers`)."""

from __future__ import annotations

import numpy as np
import pytest
from vision_references import cached

from corral.engine import load_model
from corral.images import ImageError, decode
from corral.runner.runtime import InvalidPromptError, Runtime
from corral.vision import ImageRun, ProjectorError, image_runs

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

PROMPT = "what is in the picture?"


@pytest.fixture(scope="module")
def gemma3_vision(llama_cpp_dir):
    return cached(llama_cpp_dir)


@pytest.fixture
def model(gemma3_vision):
    """A fresh fp32 model with the projector (its encoder's cache starts empty)."""
    return load_model(gemma3_vision.model, precision="fp32", projector=gemma3_vision.projector)


def expected_first_logprob(model, data: bytes) -> tuple[int, float]:
    """The greedy first token and its logprob from one forward of the engine over the same prompt."""
    ids = model.prompt_ids(PROMPT, raw=True, images=[decode(data)])
    runs = [ImageRun(start, model.vision.encode(data)) for start, _, _ in image_runs(ids, model.vision.tokens_per_image)]
    logits = model.logits(ids, images=runs)[-1].astype(np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    return int(logits.argmax()), float(logprobs.max())


@pytest.mark.parametrize("num_batch", [8, 512], ids=["image-larger-than-the-batch", "one-pass"])
async def test_a_prompt_with_an_image_gives_the_engines_first_token(model, gemma3_vision, num_batch):
    data = gemma3_vision.image.read_bytes()
    token, logprob = expected_first_logprob(model, data)
    async with Runtime.open(model, num_parallel=1, num_ctx=128, num_batch=num_batch) as rt:
        async with rt.generate(PROMPT, {"temperature": 0, "num_predict": 1}, raw=True, images=[data], logprobs=True) as stream:
            chunks = [chunk async for chunk in stream]
    first, final = [lp for chunk in chunks for lp in chunk.logprobs][0], chunks[-1]
    assert first.token == token
    assert first.logprob == pytest.approx(logprob, abs=1e-4)
    tokens = len(model.prompt_ids(PROMPT, raw=True, images=[decode(data)]))
    assert final.prompt_eval_count == tokens  # the image's rows count as prompt tokens
    assert tokens > model.vision.tokens_per_image


async def test_an_image_resent_in_a_conversation_is_encoded_once(model, gemma3_vision):
    data = gemma3_vision.image.read_bytes()
    first_turn = [{"role": "user", "content": PROMPT, "images": [data]}]
    async with Runtime.open(model, num_parallel=1, num_ctx=256) as rt:
        async with rt.chat(first_turn, {"temperature": 0, "num_predict": 4}) as stream:
            reply, _ = await stream.collect()
        second_turn = first_turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and the colours?"}]
        async with rt.chat(second_turn, {"temperature": 0, "num_predict": 4}) as stream:
            _, final = await stream.collect()
    assert model.vision.encoded == 1
    # (Its cells are not reused here: the tiny model's sliding window of 8 has forgotten the prefix.)
    assert final.prompt_eval_count > model.vision.tokens_per_image  # the image's rows counted with the prompt's


async def test_more_images_than_the_context_holds_are_refused(model, gemma3_vision):
    data = gemma3_vision.image.read_bytes()
    async with Runtime.open(model, num_parallel=1, num_ctx=40) as rt:
        with pytest.raises(InvalidPromptError, match="image\\(s\\) needs .* context cells, more than num_ctx 40"):
            async with rt.generate(PROMPT, {"num_predict": 1}, raw=True, images=[data, data, data]) as stream:
                await stream.collect()


async def test_bytes_that_are_not_an_image_are_refused(model):
    async with Runtime.open(model, num_parallel=1, num_ctx=128) as rt:
        with pytest.raises(ImageError, match="not an image"):
            async with rt.generate(PROMPT, {"num_predict": 1}, images=[b"plain text"]) as stream:
                await stream.collect()


async def test_a_model_without_a_projector_refuses_images(gemma3_vision):
    model = load_model(gemma3_vision.model, precision="fp32")
    async with Runtime.open(model, num_parallel=1, num_ctx=128) as rt:
        with pytest.raises(ProjectorError, match="no vision projector"):
            async with rt.generate(PROMPT, {"num_predict": 1}, images=[gemma3_vision.image.read_bytes()]) as stream:
                await stream.collect()


async def test_a_context_passed_back_keeps_its_image_while_the_encoder_has_it(model, gemma3_vision):
    data = gemma3_vision.image.read_bytes()
    async with Runtime.open(model, num_parallel=1, num_ctx=128) as rt:
        async with rt.generate(PROMPT, {"temperature": 0, "num_predict": 2}, raw=True, images=[data]) as stream:
            _, first = await stream.collect()
        async with rt.generate(" and then?", {"temperature": 0, "num_predict": 2}, raw=True, context=list(first.context)) as stream:
            _, second = await stream.collect()
    assert second.prompt_eval_count > len(first.context) and model.vision.encoded == 1


async def test_a_context_with_an_image_the_encoder_no_longer_has_is_refused(model, gemma3_vision):
    data = gemma3_vision.image.read_bytes()
    async with Runtime.open(model, num_parallel=1, num_ctx=128) as rt:
        async with rt.generate(PROMPT, {"num_predict": 1}, raw=True, images=[data]) as stream:
            _, first = await stream.collect()
    fresh = load_model(gemma3_vision.model, precision="fp32", projector=gemma3_vision.projector)
    async with Runtime.open(fresh, num_parallel=1, num_ctx=128) as rt:
        with pytest.raises(InvalidPromptError, match="send the image again"):
            async with rt.generate("more", {"num_predict": 1}, raw=True, context=list(first.context)) as stream:
                await stream.collect()
