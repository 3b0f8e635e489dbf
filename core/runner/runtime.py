"""The Runtime: a loaded model, its batching actor and its sequence actors, owned by one nursery.

    async with corral.Runtime.open("smollm2", num_parallel=8, num_ctx=4096) as rt:
        async with rt.generate("Why is the sky blue?", options={"temperature": 0}) as stream:
            async for chunk in stream:
                print(chunk.text, end="")

Leaving a stream's `async with` (or cancelling the caller) ends its sequence and frees its slot
before the batching actor's next step.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import AsyncIterator, Callable

import attrs
import trio

from corral import memory
from corral.engine import LoadedModel, ModelInfo, load_model, resolve_model_path
from corral.errors import InputTooLongError, InvalidPromptError
from corral.grammar import Grammar, GrammarMatcher, compile_format
from corral.kvcache import DEFAULT_KV_CACHE_TYPE, CausalCache, checked_kv_cache_type, runtime_cells, usable_kv_cache_type
from corral.options import InvalidOptionError, Options, parse_options
from corral.pooling import POOLINGS, normalize, shorten
from corral.registry import Plugins
from corral.runner import compute
from corral.runner.batching import EVENT_BUFFER, BatchingActor, Sequence
from corral.runner.embedding import EmbeddingActor
from corral.runner.interface import Embeddings, EmbeddingsUnsupportedError, GenerationUnsupportedError, RunnerStatus, RuntimeStats, Stream
from corral.runner.sequence import SequenceActor, truncate_prompt
from corral.runner.slots import SlotPool
from corral.runner.stream import Chunk
from corral.images import DecodedImage, decode
from corral.vision import ImageRun, ProjectorError, image_runs, placeholder_id
from corral.sample import MAX_TOP_LOGPROBS, SamplerChain


class RequestState(enum.Enum):
    """Where one request is in its life; each moves forward only."""

    PREPARING = "preparing"  # announced to the batching actor; tokenizing, then waiting for a slot
    RUNNING = "running"  # its sequence is in the batching actor
    FINISHED = "finished"  # ended on its own (stop, length): its cells stay for prefix reuse
    RELEASED = "released"  # slot and cells handed back; nothing more happens


@attrs.define
class Request:
    """One generation request as the runtime tracks it, from its start to its release."""

    state: RequestState = RequestState.PREPARING
    slot: int | None = None
    seq: Sequence | None = None
    error: Exception | None = None

    def finish(self) -> None:
        """The sequence ended on its own."""
        if self.state is RequestState.RUNNING:
            self.state = RequestState.FINISHED


def new_cache(model: LoadedModel, num_ctx: int, num_parallel: int, num_batch: int, cache_type: str = DEFAULT_KV_CACHE_TYPE) -> CausalCache:
    """The KV cache of a runtime: num_ctx cells per sequence, sliding-window layers their window and a batch."""
    num_cells, window_cells = runtime_cells(model.model.cache_layers(), num_ctx, num_parallel, num_batch)
    return model.new_cache(num_cells, window_cells, num_seqs=num_parallel, cache_type=cache_type)


class Runtime:
    """One loaded model served to concurrent requests."""

    def __init__(
        self, model: LoadedModel, cache: CausalCache, nursery: trio.Nursery, plugins: Plugins, num_parallel: int, num_ctx: int, num_batch: int,
        memory_estimate: int = 0,
    ):
        self.model = model
        self.memory_estimate = memory_estimate
        self.num_parallel = num_parallel
        self.num_ctx = min(num_ctx, model.info.context_length)
        self.num_batch = num_batch
        self.chain = SamplerChain(plugins)
        self.cache = cache
        self.batcher = BatchingActor(model, self.cache, self.chain, num_batch)  # steps run on the compute thread, one at a time
        # A pass takes at least one whole input: an input may be as long as the context.
        # (Not yet over the ranks of a split model: embedding passes are not mirrored to them.)
        embeds = model.model.pooling is not None and model.ranks is None
        self.embedder = EmbeddingActor(model, max(num_batch, self.num_ctx)) if embeds else None
        self.slots = SlotPool(num_parallel)
        self.stats = RuntimeStats()
        self.exited = trio.Event()
        self._nursery = nursery

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        model: str | LoadedModel,
        *,
        num_parallel: int = 4,
        num_ctx: int = 4096,
        num_batch: int = 512,
        precision: str = "auto",
        device: str | None = None,
        plugins: Plugins | None = None,
        template: str | None = None,
        num_thread: int = 0,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        projector: str | None = None,
        lower_context: bool = True,
        kv_cache_type: str = DEFAULT_KV_CACHE_TYPE,
        kv_cache_fallback: bool = False,
        name: str | None = None,
    ) -> AsyncIterator[Runtime]:
        """Load `model` (a store name or a GGUF path) and serve it until the block exits.

        `template` replaces the file's chat template (a Jinja chat template). `num_thread` > 0 sets
        the compute threads (process-wide: a runner process has one model, an embedding app decides).
        `tensor_parallel` > 1 splits every layer over that many rank processes, `pipeline_parallel`
        > 1 the blocks into that many stages (corral.parallel); the ranks stop when the block exits,
        and a rank that dies ends the runtime with RankFailedError. A `LoadedModel` is served as it
        is, with its plugins (`precision`, `device`, `num_thread` and the splits do not apply).
        `projector`: a vision projector (mmproj) file loaded beside the model, so requests may carry images.
        Before loading a file, its memory estimate is checked against what is free: the context is lowered
        to fit, or (`lower_context` false, or nothing fits) InsufficientMemoryError is raised.
        `kv_cache_type` (f16, q8_0 or q4_0, as Ollama's OLLAMA_KV_CACHE_TYPE) says how the KV cache holds keys and values;
        one the model cannot take (a head dim off the 32-value block) is refused with UnsupportedKVCacheTypeError, or, with
        `kv_cache_fallback` (the type is the server's setting, not asked for this model), replaced by f16 with a warning
        that calls the model `name` (default: the file's name).
        """
        kv_cache_type = checked_kv_cache_type(kv_cache_type)
        for key, value in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"{key} must be a positive integer, got {value!r}")
        owned = None
        estimate = 0
        if isinstance(model, LoadedModel):
            loaded, plugins = model, plugins or model.plugins
            kv_cache_type = usable_kv_cache_type(
                loaded.backend, loaded.model.cache_layers(), kv_cache_type, fallback=kv_cache_fallback, name=name or loaded.info.name
            )
        else:
            plugins = plugins or Plugins()
            path = await trio.to_thread.run_sync(resolve_model_path, model)
            plan = await compute.run(functools.partial(
                memory.plan_load, path, num_ctx, num_parallel, num_batch, plugins,
                device=device, precision=precision, lower_context=lower_context, projector=projector, kv_cache_type=kv_cache_type,
                kv_cache_fallback=kv_cache_fallback, name=name or "",
            ))
            num_ctx, estimate, kv_cache_type = plan.num_ctx, plan.estimate.total, plan.kv_cache_type
            owned = loaded = await compute.run(
                functools.partial(
                    load_model, path, precision=precision, device=device, plugins=plugins, num_thread=num_thread,
                    tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, projector=projector,
                )
            )
        try:
            async with cls._serve(loaded, plugins, template, num_parallel, num_ctx, num_batch, estimate, kv_cache_type) as runtime:
                yield runtime
        finally:
            if owned is not None:
                await compute.run(owned.close)  # a tensor-parallel model's ranks stop (its last collective, on the compute thread)

    @classmethod
    @contextlib.asynccontextmanager
    async def _serve(
        cls, loaded: LoadedModel, plugins: Plugins, template: str | None, num_parallel: int, num_ctx: int, num_batch: int,
        estimate: int, kv_cache_type: str,
    ) -> AsyncIterator[Runtime]:
        if template:
            loaded = loaded.with_template(template)  # a model the caller passed in stays as it was
        # As llama.cpp: a batch never exceeds the context, so a huge num_batch cannot size a huge buffer.
        num_batch = max(1, min(num_batch, num_ctx, loaded.info.context_length))
        if loaded.vision is not None:
            # An image's rows go in one pass (they attend to each other), so a pass must hold one: as llama.cpp
            # asks n_batch >= an image's tokens, the batch grows to it.
            num_batch = max(num_batch, loaded.vision.tokens_per_image)
        cache = await compute.run(new_cache, loaded, min(num_ctx, loaded.info.context_length), num_parallel, num_batch, kv_cache_type)
        async with trio.open_nursery() as nursery:
            runtime = cls(loaded, cache, nursery, plugins, num_parallel, num_ctx, num_batch, estimate)
            await nursery.start(runtime.batcher.run)
            if runtime.embedder is not None:
                await nursery.start(runtime.embedder.run)
            try:
                yield runtime
            finally:
                runtime.exited.set()
                nursery.cancel_scope.cancel()

    # --- the Runner interface ---------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        """What was loaded."""
        return self.model.info

    @property
    def vocab_size(self) -> int:
        return self.model.tokenizer.vocab_size

    @property
    def alive(self) -> bool:
        """Whether the runtime takes requests (until its block exits or `close`)."""
        return not self.exited.is_set()

    def status(self) -> RunnerStatus:
        """The runtime's gauges and counters now."""
        return RunnerStatus(
            num_ctx=self.num_ctx,
            num_parallel=self.num_parallel,
            num_batch=self.num_batch,
            live_sequences=len(self.batcher.sequences),
            waiting=self.slots.waiting,
            free_slots=self.slots.free,
            cache_used_cells=self.cache.used_cells(),
            cache_cells=sum(pool.num_cells for pool in self.cache.pools),
            memory_bytes=memory.resident_bytes(),
            memory_estimate=self.memory_estimate,
            batch=attrs.evolve(self.batcher.stats),
            requests=attrs.evolve(self.stats),
        )

    async def close(self) -> None:
        """End every request and the batching actor; the `open` block then exits."""
        self.exited.set()
        self._nursery.cancel_scope.cancel()

    async def embed(
        self, inputs: list[str | list[int]], truncate: bool = True, dimensions: int | None = None, normalized: bool = True
    ) -> Embeddings:
        """One vector per input (a text, or token ids), pooled as the model says; batched with other requests'.

        An input longer than the context is cut to it (keeping the closing special token, [SEP] or
        EOS, as Hugging Face's tokenizers truncate), or refused with InputTooLongError when
        `truncate` is false. `dimensions` keeps the first features; `normalized` scales to unit length.
        """
        pooling = self.model.model.pooling
        if pooling is not None and self.model.ranks is not None:
            raise EmbeddingsUnsupportedError(f"{self.info.name} is split over processes, which embeddings do not support yet; load it whole to embed")
        if self.embedder is None or pooling not in POOLINGS:
            how = f" (it pools by {pooling!r}, which corral does not do)" if pooling else "; use an embedding model"
            raise EmbeddingsUnsupportedError(f"{self.info.name} does not support embeddings{how}")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
            raise InvalidOptionError(f"dimensions must be a positive integer, got {dimensions!r}")
        ids = await trio.to_thread.run_sync(self._embedding_ids, list(inputs), truncate)
        if not ids:
            return Embeddings([], 0)
        self.stats.requests += 1
        self.stats.prompt_tokens += sum(map(len, ids))
        vectors = shorten(await self.embedder.embed(ids), dimensions)
        if normalized:
            vectors = normalize(vectors)
        return Embeddings(vectors.tolist(), sum(map(len, ids)))

    # --- public API -----------------------------------------------------------------------
    def parse_options(self, options: dict | None) -> Options:
        """Validated options, including those the installed sampler plugins declare."""
        return parse_options(options, self.chain.extra_options)

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
        images: tuple[bytes, ...] | list[bytes] = (),
        think: bool | str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Stream]:
        """Stream the completion of `prompt` (wrapped in the chat template as a user turn unless `raw`).

        `format` ("json" or a JSON-schema object) constrains the output to one such JSON value; `think` (true/false or
        an effort level; None: the template's default) sets the template's thinking switch.
        `images` (image files' bytes) go where the prompt's `[img-N]` tags say, or before its text.
        """
        opts = self.parse_options(options)
        grammar = compile_format(format)

        def prompt_ids() -> tuple[list[int], list[DecodedImage]]:
            decoded = self._decode_images(images)
            return self.model.prompt_ids(prompt, raw=raw, system=system, context=context or (), images=decoded, think=think), decoded

        return self._stream(prompt_ids, opts, shift, logprobs, top_logprobs, grammar)

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
        """Stream the assistant's reply to `messages`; the oldest turns are dropped if they do not fit.

        A message's `images` (image files' bytes) go before its text, or where its `[img-N]` tags say.

        `think` (true/false or an effort level; None: the template's default) sets the template's thinking switch.

        `format` ("json" or a JSON-schema object) constrains the reply to one such JSON value.
        """
        opts = self.parse_options(options)
        grammar = compile_format(format)
        num_ctx = self._num_ctx(opts)

        def prompt_ids() -> tuple[list[int], list[DecodedImage]]:
            decoded = [{**m, "images": self._decode_images(m["images"])} if m.get("images") else m for m in messages]
            return self._fit_messages(decoded, num_ctx, tools, think), [image for m in decoded for image in m.get("images") or ()]

        return self._stream(prompt_ids, opts, shift, logprobs, top_logprobs, grammar)

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`."""
        return await trio.to_thread.run_sync(functools.partial(self.model.tokenize, text, add_special=add_special))

    async def detokenize(self, ids: list[int]) -> str:
        """Text of token ids."""
        return await trio.to_thread.run_sync(self.model.detokenize, ids)

    # --- internals ------------------------------------------------------------------------
    def _num_ctx(self, opts: Options) -> int:
        return min(opts.num_ctx or self.num_ctx, self.num_ctx)

    def _decode_images(self, images: tuple[bytes, ...] | list[bytes]) -> list[DecodedImage]:
        """The request's images read (ImageError for one that is not); ProjectorError when the model cannot see."""
        if images and self.model.vision is None:
            raise ProjectorError(f"{self.info.name} has no vision projector: it does not support images")
        return [decode(data) for data in images]

    async def _image_runs(self, ids: list[int], images: list[DecodedImage], num_ctx: int) -> tuple[ImageRun, ...]:
        """Each image of the prompt encoded (or taken from the encoder's cache) at its rows: the request's
        images, and those of a `context` passed back (while the encoder still keeps them)."""
        vision = self.model.vision
        if vision is None or not any(token < 0 for token in ids):
            return ()
        if len(ids) > num_ctx:
            raise InvalidPromptError(
                f"the prompt with its image(s) needs {len(ids)} context cells, more than num_ctx {num_ctx}; "
                "send fewer images or a shorter prompt, or raise num_ctx"
            )
        by_placeholder = {placeholder_id(image.digest): image for image in images}
        runs = []
        for start, _, token in image_runs(ids, vision.tokens_per_image):
            image = by_placeholder.get(token)
            embeddings = await compute.run(vision.encode, image) if image is not None else vision.kept(token)
            if embeddings is None:
                raise InvalidPromptError("the context holds an image this model has not seen lately; send the image again with the request")
            runs.append(ImageRun(start, embeddings, image.digest if image is not None else ""))
        return tuple(runs)

    def _embedding_ids(self, inputs: list[str | list[int]], truncate: bool) -> list[list[int]]:
        """Each input's token ids, within the context."""
        vocab = self.model.tokenizer.vocab_size
        suffix = self._closing_tokens()
        out = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                ids, keep = self.model.tokenize(item), suffix
            else:
                ids, keep = [int(token) for token in item], []
                if not all(0 <= token < vocab for token in ids):
                    raise InvalidPromptError(f"input {index} has token ids outside the vocabulary of {vocab} tokens")
            if not ids:
                raise InvalidPromptError(f"input {index} is empty: it has no tokens to embed")
            if len(ids) > self.num_ctx:
                if not truncate:
                    raise InputTooLongError(
                        f"input {index} is {len(ids)} tokens, longer than the context of {self.num_ctx}; shorten it or allow truncation"
                    )
                ids = ids[: self.num_ctx - len(keep)] + keep
            out.append(ids)
        return out

    def _closing_tokens(self) -> list[int]:
        """The special tokens the tokenizer puts after a text ([SEP]; EOS where the model adds it)."""
        framing = self.model.tokenize("")
        return framing[1:] if self.model.tokenizer.add_bos and framing else framing

    def _fit_messages(self, messages: list[dict], num_ctx: int, tools: list[dict] | None = None, think: bool | str | None = None) -> list[int]:
        # Drop the oldest turns (never a system message, never the last one) until the prompt fits.
        messages = list(messages)
        ids = self.model.chat_ids(messages, tools, think)
        while len(ids) > num_ctx:
            droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
            if not droppable:
                break
            del messages[droppable[0]]
            ids = self.model.chat_ids(messages, tools, think)
        return ids

    @contextlib.asynccontextmanager
    async def _stream(
        self,
        prompt_ids: Callable[[], list[int]],
        opts: Options,
        shift: bool,
        logprobs: bool,
        top_logprobs: int,
        grammar: Grammar | None = None,
    ) -> AsyncIterator[Stream]:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            # raised inside the batching actor's step, it would end the runtime
            raise InvalidOptionError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs!r}")
        if not self.model.model.generates:
            raise GenerationUnsupportedError(f"{self.info.name} is an embedding model: it does not support generate or chat; use /api/embed")
        send, receive = trio.open_memory_channel(0)
        request = Request()
        scope = trio.CancelScope()
        self.batcher.expect()
        self._nursery.start_soon(self._run_sequence, scope, prompt_ids, opts, shift, logprobs, top_logprobs, grammar, send, request)
        try:
            async with receive:
                yield Stream(functools.partial(self._next_chunk, receive, request))
        finally:
            scope.cancel()
            self._release(request)

    @staticmethod
    async def _next_chunk(channel: trio.MemoryReceiveChannel, request: Request) -> Chunk | None:
        try:
            chunk = await channel.receive()
        except trio.EndOfChannel:
            if request.error is not None:
                error, request.error = request.error, None
                raise error from None
            return None
        if chunk.done:
            request.finish()
        return chunk

    async def _run_sequence(
        self,
        scope: trio.CancelScope,
        prompt_ids: Callable[[], list[int]],
        opts: Options,
        shift: bool,
        logprobs: bool,
        top_logprobs: int,
        grammar: Grammar | None,
        out: trio.MemorySendChannel,
        request: Request,
    ) -> None:
        with scope:
            async with out:
                try:
                    await self._sequence(prompt_ids, opts, shift, logprobs, top_logprobs, grammar, out, request)
                except Exception as exc:  # reported to this request's reader, never to the runtime
                    request.error = exc
                finally:
                    if request.state is RequestState.PREPARING:
                        self.batcher.arrived()  # failed before its sequence was added
                    self._release(request)

    async def _sequence(self, prompt_ids, opts: Options, shift, logprobs, top_logprobs, grammar, out, request: Request) -> None:
        num_ctx = self._num_ctx(opts)
        ids, images = await trio.to_thread.run_sync(prompt_ids)
        runs = await self._image_runs(ids, images, num_ctx)
        # The model's first constrained request builds its llguidance tokenizer: off the event loop.
        matcher = await trio.to_thread.run_sync(GrammarMatcher.start, self.model.tokenizer, grammar) if grammar else None
        if not ids:
            raise InvalidPromptError("the prompt is empty")
        vocab = self.model.tokenizer.vocab_size
        if not all(0 <= token < vocab or (token < 0 and runs) for token in ids):  # negative: an image's rows
            raise InvalidPromptError(f"the context has token ids outside the vocabulary of {vocab} tokens; pass back a context this model returned")
        num_keep = min(len(ids) if opts.num_keep < 0 else opts.num_keep, num_ctx - 1)  # -1: the whole prompt
        ids = truncate_prompt(ids, num_ctx, num_keep)
        num_predict, shift = (-1, False) if opts.num_predict == -2 else (opts.num_predict, shift)  # -2: fill the context
        # The steps active for it prepare their state first (DRY reads the vocabulary once per model): off the loop.
        start = functools.partial(self.chain.start, opts, ids, num_ctx, grammar=matcher, tokenizer=self.model.tokenizer)
        sampler = await trio.to_thread.run_sync(start)
        slot, reused = await self.slots.acquire(ids, self._reusable)
        request.slot = slot
        self.cache.remove(slot, reused)
        self._count(ids, reused)
        events_send, events_receive = trio.open_memory_channel(EVENT_BUFFER + 2)
        seq = Sequence(
            id=slot,
            prompt=ids,
            pending=ids[reused:],
            position=reused,
            cached=ids[:reused],
            sampler=sampler,
            events=events_send,
            num_predict=num_predict,
            num_ctx=num_ctx,
            num_keep=num_keep,
            shift=shift,
            top_logprobs=top_logprobs if logprobs else 0,
            logprobs=logprobs,
            images=tuple(run for run in runs if run.start >= reused),
            bidirectional_images=self.model.model.bidirectional_images,
        )
        request.seq, request.state = seq, RequestState.RUNNING
        self.batcher.arrived()
        self.batcher.add(seq)
        actor = SequenceActor(seq, self.model.tokenizer, opts.stop, reused, logprobs, resume=self.batcher.wake)
        async with events_receive:
            await actor.run(events_receive, out)
        if actor.done_reason is not None:
            request.finish()

    def _reusable(self, slot: int, tokens: list[int], prompt: list[int]) -> int:
        """How many leading prompt tokens `slot`'s cached tokens can serve (at least one must be computed)."""
        common = 0
        for a, b in zip(tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        while common and prompt[common] < 0 and prompt[common - 1] == prompt[common]:
            common -= 1  # never reuse part of an image: its rows are computed together
        if common and not self.cache.has_window_cells(slot, common):
            return 0  # a sliding-window layer already forgot what the prefix's end needs
        return common

    def _count(self, ids: list[int], reused: int) -> None:
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        self.stats.prompt_tokens_reused += reused
        self.stats.cache_hits += reused > 0

    def _release(self, request: Request) -> None:
        # Idempotent: runs from the actor's finally and from the reader's exit, whichever is first.
        if request.state is RequestState.RELEASED or request.slot is None:
            return
        finished = request.state is RequestState.FINISHED
        request.state = RequestState.RELEASED
        slot, seq = request.slot, request.seq
        if seq is not None:
            self.batcher.remove(seq, keep_cells=finished)
        if not finished:
            self.cache.remove(slot)
        self.slots.release(slot, seq.cached if finished and seq is not None else [])

