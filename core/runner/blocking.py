"""The Runtime for blocking callers: `LoadedModel.generate` and `corral run` without a server.

    with BlockingRuntime(loaded, num_ctx=4096) as rt:
        for chunk in rt.chat([{"role": "user", "content": "Hi"}], {"stop": ["."]}):
            print(chunk.text, end="")

A Trio loop in a thread of its own runs one `Runtime` (one sequence slot) over a model. Each
generation is a task on that loop that relays the stream's chunks over a channel, which the calling
thread reads through `trio.from_thread`: so a synchronous caller gets the same sequence and batching
actors, stop strings, `format`, sampler options and final counts as the server. Leaving the iterator
early (a `break`, Ctrl-C) ends the generation and frees its slot.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import trio

from corral.engine import LoadedModel
from corral.runner.runtime import Runtime
from corral.runner.stream import Chunk


@attrs.frozen
class _Failed:
    """The generation raised `error`; its reader re-raises it."""

    error: BaseException


class BlockingRuntime:
    """A Runtime over `model` (a LoadedModel, a store name or a GGUF path) for callers that are not Trio tasks."""

    def __init__(self, model: LoadedModel | str, *, num_ctx: int, num_batch: int = 512, **open_options: Any):
        self.num_ctx = num_ctx  # as asked; the runtime clamps it to the model's trained context
        self.num_batch = num_batch
        self._open = functools.partial(Runtime.open, model, num_parallel=1, num_ctx=num_ctx, num_batch=num_batch, **open_options)
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._runtime: Runtime | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), name="corral-blocking-runtime", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    @property
    def model(self) -> LoadedModel:
        """The loaded model the runtime serves."""
        return self._runtime.model

    def generate(self, prompt: str, options: dict | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """The chunks of `Runtime.generate(prompt, options, **kwargs)`; the last one has `done`."""
        return self._chunks(lambda rt: rt.generate(prompt, options, **kwargs))

    def chat(self, messages: list[dict], options: dict | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """The chunks of `Runtime.chat(messages, options, **kwargs)`; the last one has `done`."""
        return self._chunks(lambda rt: rt.chat(messages, options, **kwargs))

    def close(self) -> None:
        """End the runtime and its thread; generations still running end with it."""
        if self._runtime is not None:
            try:
                trio.from_thread.run_sync(self._closing.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass  # already closed
        self._thread.join()

    def __enter__(self) -> BlockingRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the Trio side --------------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            async with self._open() as runtime, trio.open_nursery() as nursery:
                self._runtime, self._nursery = runtime, nursery
                self._token = trio.lowlevel.current_trio_token()
                self._closing = trio.Event()
                self._started.set()
                await self._closing.wait()
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if self._started.is_set():
                raise
            self._failure = exc  # a model that cannot load: the constructor raises it
            self._started.set()

    async def _relay(self, start: Callable[[Runtime], Any], scope: trio.CancelScope, send: trio.MemorySendChannel) -> None:
        with scope:
            async with send:
                try:
                    async with start(self._runtime) as stream:
                        async for chunk in stream:
                            await send.send(chunk)
                except Exception as exc:  # the request's own error, for its reader; never the runtime's end
                    await send.send(_Failed(exc))

    # --- the caller's side ----------------------------------------------------------------
    def _chunks(self, start: Callable[[Runtime], Any]) -> Iterator[Chunk]:
        send, receive = trio.open_memory_channel(0)
        scope = trio.CancelScope()
        trio.from_thread.run_sync(self._nursery.start_soon, self._relay, start, scope, send, trio_token=self._token)
        try:
            while (item := trio.from_thread.run(_next, receive, trio_token=self._token)) is not None:
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            # Also when the reader stops early: the relay's sequence ends and frees its slot.
            trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
            trio.from_thread.run_sync(receive.close, trio_token=self._token)


async def _next(receive: trio.MemoryReceiveChannel) -> Chunk | _Failed | None:
    try:
        return await receive.receive()
    except trio.EndOfChannel:
        return None
