"""The one interface every runner offers: the in-process `Runtime` and the child-process `RunnerProcess`.

The scheduler, the server and the metrics hold a `Runner` and read nothing else of it: requests go
through `generate`/`chat`/`tokenize`/`detokenize`/`embed`, gauges through `status()`, liveness
through `alive` and `exited`. A runner's status is a plain value (`RunnerStatus`), so a child
process can send it over the wire and the parent can hand it on unchanged.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Awaitable, Callable, Protocol, Sequence, runtime_checkable

import attrs
import trio

from corral.model_info import ModelInfo
from corral.errors import CorralError
from corral.runner.stream import Chunk


class EmbeddingsUnsupportedError(CorralError, ValueError):
    """The model was not built to produce embeddings (it has no pooling)."""


class GenerationUnsupportedError(CorralError, ValueError):
    """The model only embeds (an encoder): it cannot generate text."""


@attrs.frozen
class Embeddings:
    """The vectors of one embed call, in input order, and the tokens they were computed from."""

    embeddings: list[list[float]]
    prompt_eval_count: int

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Embeddings:
        return cls(data["embeddings"], int(data["prompt_eval_count"]))


@attrs.define
class BatchStats:
    """Counters the server's /metrics reads (the batching actor keeps them; here so the server reads them without torch)."""

    steps: int = 0
    last_batch_size: int = 0
    tokens_computed: int = 0
    shifts: int = 0


@attrs.define
class RuntimeStats:
    """Requests started and their prompt tokens, including those served from the prefix cache."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0
    cache_hits: int = 0


@attrs.frozen
class RunnerStatus:
    """A runner's gauges and counters at one moment."""

    num_ctx: int
    num_parallel: int
    num_batch: int
    live_sequences: int = 0  # sequences the batching actor is running
    waiting: int = 0  # requests waiting for a sequence slot
    free_slots: int = 0
    cache_used_cells: int = 0  # KV cache cells holding a token
    cache_cells: int = 0  # KV cache cells allocated, over all pools
    memory_bytes: int = 0  # resident memory plus CUDA allocations of the process that holds the model
    memory_estimate: int = 0  # the load's prediction (weights + KV cache + compute), the scheduler's size of the model
    batch: BatchStats = attrs.field(factory=BatchStats)  # copies, not the live counters
    requests: RuntimeStats = attrs.field(factory=RuntimeStats)

    def to_json(self) -> dict:
        """A JSON-able dict (nested counters as dicts)."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunnerStatus:
        """The status `to_json` wrote; unknown keys (a newer runner) are ignored."""
        fields = _known(cls, data)
        fields["batch"] = BatchStats(**_known(BatchStats, data.get("batch") or {}))
        fields["requests"] = RuntimeStats(**_known(RuntimeStats, data.get("requests") or {}))
        return cls(**fields)


def _known(cls: type, data: dict) -> dict:
    names = {field.name for field in attrs.fields(cls)}
    return {key: value for key, value in data.items() if key in names}


class Stream:
    """The chunks of one generation; raises the request's error, if any, after the last chunk.

    `receive` returns the next chunk, or None at the end (raising the request's error there instead
    when it failed); both runners build their streams on it.
    """

    def __init__(self, receive: Callable[[], Awaitable[Chunk | None]]):
        self._receive = receive
        self._ended = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        try:
            chunk = await self._receive()
        except BaseException:
            self._ended = True
            raise
        if chunk is None:
            self._ended = True
            raise StopAsyncIteration
        return chunk

    async def collect(self) -> tuple[str, Chunk | None]:
        """All the text and the final chunk."""
        pieces, last = [], None
        async for chunk in self:
            pieces.append(chunk.text)
            last = chunk
        return "".join(pieces), last


@runtime_checkable
class Runner(Protocol):
    """One loaded model, served to concurrent requests."""

    info: ModelInfo  # what was loaded
    vocab_size: int
    exited: trio.Event  # set once the runner can serve no more requests

    @property
    def alive(self) -> bool:
        """Whether the runner can take requests."""

    @property
    def num_ctx(self) -> int:
        """Context length per sequence, after clamping to the model's trained context."""

    def generate(
        self,
        prompt: str,
        options: dict | None = None,
        *,
        raw: bool = False,
        system: str | None = None,
        context: list[int] | None = None,
        shift: bool = True,
        logprobs: bool = False,
        top_logprobs: int = 0,
        format: str | dict | None = None,
        images: Sequence[bytes] = (),
        think: bool | str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Stream]:
        """Stream the completion of `prompt` (in the chat template as a user turn unless `raw`; `images`: image
        files' bytes, for a model with a vision projector; `think` sets the template's thinking switch, None its default)."""

    def chat(
        self,
        messages: list[dict],
        options: dict | None = None,
        *,
        tools: list[dict] | None = None,
        shift: bool = True,
        logprobs: bool = False,
        top_logprobs: int = 0,
        format: str | dict | None = None,
        think: bool | str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Stream]:
        """Stream the assistant's reply to `messages` (`think`: the template's thinking switch; None: its default)."""

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`."""

    async def detokenize(self, ids: list[int]) -> str:
        """Text of token ids."""

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], truncate: bool = True, dimensions: int | None = None, normalized: bool = True
    ) -> Embeddings:
        """One embedding per input (text or token ids), L2-normalised unless `normalized` is false;
        EmbeddingsUnsupportedError for a model without pooling."""

    def status(self) -> RunnerStatus:
        """The runner's gauges and counters (a child process's as of its last health check)."""

    async def close(self) -> None:
        """Stop serving: requests in flight end, and `exited` is set."""
