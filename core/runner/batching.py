"""The batching actor: one per loaded model, it runs every live sequence through shared forward passes.

Each step is three calls (as in vLLM's engine): `plan_step` picks the work under one token budget,
`execute` runs forward + sampling off the event loop, `update` hands each sequence its token.
There is no prefill phase: a sequence's pending tokens are its prompt remainder or its last sampled
token, and long prompts are fed in chunks so running sequences keep decoding.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import attrs
import numpy as np
import trio

from corral.kvcache import CausalCache, shift_sequence
from corral.model import Batch
from corral.runner import compute
from corral.runner.interface import BatchStats
from corral.sample import SampleResult, SamplerChain, SequenceSampler
from corral.vision import IMAGE_FILLER, ImageRun, image_batch_fields

EVENT_BUFFER = 64  # tokens a sequence may run ahead of its reader before it is paused
ARRIVAL_WAIT = 0.01  # seconds the first step after idling waits for requests still on their way


@attrs.frozen
class Sampled:
    """A generated token (never an end-of-generation token)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class Finished:
    """The sequence ended: "stop" (end of generation, or its format complete) or "length" (num_predict, or num_ctx without shift)."""

    reason: str


@attrs.define(eq=False)
class Sequence:
    """A sequence's state shared by its actor and the batching actor."""

    id: int  # its cache sequence id (the slot)
    prompt: list[int]
    pending: list[int]  # tokens to feed: the uncached prompt remainder, then the last sampled token
    position: int  # position of pending[0]
    sampler: SequenceSampler
    events: trio.MemorySendChannel
    num_predict: int = -1
    num_ctx: int = 4096
    num_keep: int = 4
    shift: bool = True
    top_logprobs: int = 0
    logprobs: bool = False  # the client wants the chosen tokens' logprobs
    cached: list[int] = attrs.field(factory=list)  # tokens whose keys are in the cache, in order
    generated: int = 0
    finished: bool = False
    started_ns: int = attrs.field(factory=time.perf_counter_ns)
    first_token_ns: int = 0
    last_token_ns: int = 0
    images: tuple[ImageRun, ...] = ()  # the prompt's images, by prompt index; a chunk never cuts one
    bidirectional_images: bool = False

    @property
    def decoding(self) -> bool:
        return len(self.pending) == 1 and self.generated > 0

    def paused(self) -> bool:
        """Its reader is EVENT_BUFFER tokens behind: skip it until it catches up."""
        return self.events.statistics().current_buffer_used >= EVENT_BUFFER


def plan_step(sequences: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
    """Which sequences feed how many tokens this step: every decode token, then prompt chunks in order.

    A prompt is always cut into the same chunks (`budget` tokens each, the last shorter), whatever
    else runs, and a chunk that does not fit this step's budget waits for the next. Every sequence
    thus sees the same kernel calls alone or batched, which keeps its output bit-identical (batch
    invariance). Decode tokens (one per running sequence, so at most num_parallel) ride on top of
    the budget: otherwise a full-size chunk would never fit beside them and a long prompt would
    wait for every other sequence to finish.

    The chunks start where the cache stops serving the prompt: a prefix reused from a slot's
    earlier sequence (even its BOS alone) shifts them, and the reused cells were computed in that
    sequence's own chunks. A kernel's path depends on a run's length (layouts.py), so output after
    reuse can differ from a cold start in the last bits, as in llama.cpp; batching alone never
    changes it.
    """
    plan, left = [], budget
    runnable = [s for s in sequences if not s.finished and s.pending and not s.paused()]
    plan += [(seq, 1) for seq in runnable if seq.decoding]
    for seq in runnable:
        if seq.decoding:
            continue
        chunk = image_chunk(seq, min(len(seq.pending), budget))
        if chunk > left and (left < budget or chunk <= budget):
            break  # first come, first served: later prompts do not overtake this one
        plan.append((seq, chunk))
        left -= chunk
    return plan


def image_chunk(seq: Sequence, chunk: int) -> int:
    """`chunk` moved so that no image is cut: it ends before an image it would cut, or, starting at
    an image, takes it whole (even past the budget: an image's rows attend to each other in one pass)."""
    start = len(seq.cached)
    for run in seq.images:
        if run.start < start + chunk < run.start + run.length:
            return run.start - start if run.start > start else run.start + run.length - start
    return chunk


def build_batch(plan: list[tuple[Sequence, int]]) -> tuple[Batch, list[Sequence]]:
    """The Batch for a plan and the sequences whose last row yields logits, in output order."""
    inputs, positions, seqs, outputs, emitting = [], [], [], [], []
    images: list[tuple[ImageRun, int, bool]] = []  # a run, the batch row of its first row, whether it is bidirectional
    row = 0
    for seq, count in plan:
        start = len(seq.cached)  # the prompt index of pending[0]
        images += [(run, row + run.start - start, seq.bidirectional_images) for run in seq.images if start <= run.start < start + count]
        inputs += [IMAGE_FILLER if token < 0 else token for token in seq.pending[:count]]
        positions += range(seq.position, seq.position + count)
        seqs += [seq.id] * count
        row += count
        if count == len(seq.pending):
            outputs.append(row - 1)
            emitting.append(seq)
    as_array = functools.partial(np.asarray, dtype=np.int64)
    batch = Batch(as_array(inputs), as_array(positions), as_array(seqs), as_array(outputs))
    return (attrs.evolve(batch, **batch_images(images, row)) if images else batch), emitting


def batch_images(images: list[tuple[ImageRun, int, bool]], rows: int) -> dict:
    """The image fields of a batch of `rows` rows (`image_batch_fields` with each run at its batch row)."""
    fields = image_batch_fields([attrs.evolve(run, start=first) for run, first, _ in images], range(rows), bidirectional=True)
    for run, first, bidirectional in images:
        if not bidirectional:
            fields["blocks"][first : first + run.length] = -1
    return fields


class BatchingActor:
    """Owns the model's forward passes; sequences join and leave between any two steps."""

    def __init__(self, model: Any, cache: CausalCache, chain: SamplerChain, num_batch: int):
        self.model = model
        self.cache = cache
        self.chain = chain
        self.num_batch = num_batch
        self.sequences: list[Sequence] = []
        self.stats = BatchStats()
        self.arriving = 0  # requests expected but not yet added (their prompts tokenize in threads)
        self._wake = trio.Event()

    def expect(self) -> None:
        """A request has started: its sequence will be added, or `arrived` called, soon."""
        self.arriving += 1

    def arrived(self) -> None:
        """An expected request is added now, or will never be."""
        self.arriving -= 1
        self.wake()

    def add(self, seq: Sequence) -> None:
        """Start scheduling `seq`."""
        self.sequences.append(seq)
        self.wake()

    def remove(self, seq: Sequence, keep_cells: bool) -> None:
        """Stop scheduling `seq` (takes effect before the next step); free its cells unless kept for reuse."""
        seq.finished = True
        if seq in self.sequences:
            self.sequences.remove(seq)
        if not keep_cells:
            self.cache.remove(seq.id)

    def wake(self) -> None:
        """Tell the loop there may be new work."""
        self._wake.set()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The step loop; runs until cancelled with the runtime."""
        task_status.started()
        while True:
            await self._apply_context_limits()
            plan = plan_step(self.sequences, self.num_batch)
            if not plan:
                self._wake = trio.Event()
                await self._wake.wait()
                await self._await_arrivals()
                continue
            batch, emitting = build_batch(plan)
            view = self.cache.prepare(batch)
            result = await compute.run(self._execute, batch, view, emitting)
            self._update(plan, emitting, result)

    async def _await_arrivals(self) -> None:
        # Requests that come together finish tokenizing one by one: a step for the first alone and
        # another for the rest costs more than one step for all of them (measured: BENCHMARKS.md,
        # core/runner/batching.py). So after idling, wait briefly for those already on their way.
        with trio.move_on_after(ARRIVAL_WAIT):
            while self.arriving > 0:
                self._wake = trio.Event()
                await self._wake.wait()

    def _execute(self, batch: Batch, view: Any, emitting: list[Sequence]) -> SampleResult:
        logits = self.model.backend.run(self.model.model, batch, view)
        if not emitting:  # only prompt chunks: no row to sample (the chain's steps expect at least one)
            return SampleResult([], [], [])
        samplers, logprobs = [s.sampler for s in emitting], any(s.logprobs for s in emitting)
        return self.chain.sample(logits, samplers, [s.top_logprobs for s in emitting], logprobs=logprobs)

    def _update(self, plan: list[tuple[Sequence, int]], emitting: list[Sequence], result: SampleResult) -> None:
        self.stats.steps += 1
        self.stats.last_batch_size = sum(count for _, count in plan)
        self.stats.tokens_computed += self.stats.last_batch_size
        for seq, count in plan:
            if seq.finished:
                continue  # removed while the step ran
            seq.cached += seq.pending[:count]
            seq.pending = seq.pending[count:]
            seq.position += count
        now = time.perf_counter_ns()
        eog = self.model.tokenizer.eog_ids
        for row, seq in enumerate(emitting):
            if seq.finished:
                continue
            token = result.tokens[row]
            seq.first_token_ns = seq.first_token_ns or now
            seq.last_token_ns = now
            if token in eog and not seq.sampler.options.ignore_eos:
                self._finish(seq, "stop")
                continue
            seq.sampler.accept(token)
            seq.generated += 1
            if not self._send(seq, Sampled(token, result.logprobs[row], tuple(result.top_logprobs[row]))):
                continue
            if seq.sampler.complete:
                self._finish(seq, "stop")  # its format's grammar is complete: nothing may follow
            elif 0 <= seq.num_predict <= seq.generated:
                self._finish(seq, "length")
            else:
                seq.pending = [token]

    def _send(self, seq: Sequence, event: Sampled | Finished) -> bool:
        try:
            seq.events.send_nowait(event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            self.remove(seq, keep_cells=False)  # its actor is gone
            return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._send(seq, Finished(reason))
        self.remove(seq, keep_cells=True)

    async def _apply_context_limits(self) -> None:
        for seq in list(self.sequences):
            if not seq.decoding or seq.position < seq.num_ctx:
                continue
            if not seq.shift or seq.num_ctx - seq.num_keep < 2:
                self._finish(seq, "length")
                continue
            await compute.run(self._shift, seq)

    def _shift(self, seq: Sequence) -> None:
        # Keep num_keep tokens, drop half of the rest, and slide the remainder back (llama.cpp's context shift).
        keep = seq.num_keep
        discard = (seq.num_ctx - keep) // 2
        self.cache.remove(seq.id, keep, keep + discard)
        shift_sequence(self.model.model, self.cache, seq.id, keep + discard, -discard)
        seq.cached = seq.cached[:keep] + seq.cached[keep + discard :]
        seq.position -= discard
        self.stats.shifts += 1
