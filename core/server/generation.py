"""One path from a generation request to runtime chunks, shared by the Ollama and OpenAI APIs.

It applies the model's Modelfile defaults (options: request > Modelfile > environment > built-in;
the SYSTEM message and MESSAGES when the request brings none), loads the model through the
scheduler, streams the runtime's chunks, and counts tokens for /metrics.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

import attrs
import trio

from corral.modelfile.defaults import ModelDefaults, model_defaults
from corral.runner.interface import Runner
from corral.runner.stream import Chunk
from corral.server.state import state


@attrs.frozen
class Prepared:
    """What a handler's `start` callback gets: the runtime, merged options and the model's defaults."""

    runtime: Runner
    options: dict
    defaults: ModelDefaults

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """The request's messages behind the Modelfile's MESSAGES, with its SYSTEM unless one is given."""
        return self.defaults.chat_messages(messages)


async def chunks(
    model: str, options: dict, keep_alive: Any, start: Callable[[Prepared], contextlib.AbstractAsyncContextManager]
) -> AsyncIterator[Chunk]:
    """The runtime's chunks for one request; the last has `done`."""
    server = state()  # read now: a streamed body runs outside the app context
    defaults = await trio.to_thread.run_sync(model_defaults, server.store, model)
    merged = defaults.merge_options(options)
    async with server.scheduler.use(model, merged, keep_alive) as loaded:
        async with start(Prepared(loaded.runtime, merged, defaults)) as stream:
            async for chunk in stream:
                if chunk.done and server.metrics is not None:
                    server.metrics.record_generation(chunk.prompt_eval_count, chunk.eval_count)
                yield chunk


async def started(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`items` run up to its first item now, so errors before any output get a real status code."""
    first = await items.__anext__()

    async def rest() -> AsyncIterator[Any]:
        async with contextlib.aclosing(items):
            yield first
            async for item in items:
                yield item

    return rest()
