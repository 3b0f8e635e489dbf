"""What the tensor- and pipeline-parallel tests compare between a split model and the same model in one process."""

from __future__ import annotations

import trio

from corral.runner.runtime import Runtime

PROMPT = [1, 5, 9, 22, 40, 7, 3, 11]
GREEDY = {"temperature": 0, "num_predict": 12, "ignore_eos": True}
PROMPTS = ["the cat sat on the mat", "a", "xyz 123 and more"]


async def greedy_tokens(model) -> list[list[int]]:
    """Each of PROMPTS' greedy tokens, generated side by side (batched) in one runtime over `model`."""
    results: list = [None] * len(PROMPTS)
    async with Runtime.open(model, num_parallel=4, num_ctx=64) as rt:

        async def one(i):
            async with rt.generate(PROMPTS[i], dict(GREEDY), raw=True) as stream:
                results[i] = [t async for chunk in stream for t in chunk.token_ids]

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    assert all(len(tokens) == GREEDY["num_predict"] for tokens in results)
    return results
