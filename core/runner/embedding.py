"""The runtime's embedding path: no sampling, no KV cache kept, requests batched together.

One `EmbeddingActor` per runtime takes the inputs of every request waiting when it wakes, orders
them by length (less padding in an encoder's attention), packs them into forward passes of at most
`budget` tokens and pools each pass's hidden states (pooling.py). An encoder runs each pass
without a cache; a decoder embedding model (Qwen3-Embedding: last-token pooling) runs its causal
attention over a cache made for the pass and dropped after it.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import attrs
import numpy as np
import torch
import trio

from corral.engine import LoadedModel
from corral.kvcache import CausalCache
from corral.model import Batch
from corral.pooling import output_rows, pool
from corral.runner import compute


def embedding_batch(inputs: Sequence[Sequence[int]], pooling: str) -> Batch:
    """Inputs laid out one after another, each from position 0, returning the rows `pooling` reads."""
    lengths = [len(ids) for ids in inputs]
    return Batch(
        np.concatenate([np.asarray(ids, dtype=np.int64) for ids in inputs]),
        np.concatenate([np.arange(length, dtype=np.int64) for length in lengths]),
        np.repeat(np.arange(len(inputs), dtype=np.int64), lengths),
        output_rows(lengths, pooling),
    )


def embed_pass(model: LoadedModel, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """One forward pass over `inputs` (none empty): their pooled, unnormalised vectors [inputs, dim]."""
    pooling = model.model.pooling
    batch = embedding_batch(inputs, pooling)
    if model.model.generates:  # causal attention needs cells: one region per input, freed with the pass
        layers = model.model.cache_layers()
        longest = max(len(ids) for ids in inputs)
        view = CausalCache(model.backend, layers, longest * len(inputs), longest * len(inputs), num_seqs=len(inputs)).prepare(batch)
        ctx = model.backend.new_context(batch, view)
    else:
        # The backend runs a linear once per run of one sequence's rows (batch invariance for the
        # cached decode); told the rows are one sequence, it runs one product over all the inputs.
        view, ctx = None, model.backend.new_context(attrs.evolve(batch, sequences=np.zeros(len(batch), dtype=np.int64)))
    (hidden,) = ctx.compute(model.model.hidden_states(ctx, batch, view))
    return pool(hidden, [len(ids) for ids in inputs], pooling)


def passes(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Input indices by increasing length, cut into passes of at most `budget` tokens (an input longer
    than the budget gets a pass of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    tokens = budget
    for i in order:
        if tokens + lengths[i] > budget:
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += lengths[i]
    return out


@attrs.define
class EmbedJob:
    """One request's inputs, and its vectors once the actor has computed them."""

    inputs: list[list[int]]
    done: trio.Event = attrs.field(factory=trio.Event)
    vectors: torch.Tensor | None = None
    error: BaseException | None = None


class EmbeddingActor:
    """Computes the embeddings of all requests waiting at each wake-up together."""

    def __init__(self, model: LoadedModel, budget: int):
        self.model = model
        self.budget = budget
        self.passes = 0  # forward passes run, all requests together
        self._send, self._receive = trio.open_memory_channel(0)

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """The pooled vectors of `inputs` [len(inputs), dim], computed with whatever else is waiting."""
        job = EmbedJob(inputs)
        await self._send.send(job)
        await job.done.wait()
        if job.error is not None:
            raise job.error
        return job.vectors

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve jobs until cancelled."""
        task_status.started()
        async with self._receive:
            async for job in self._receive:
                jobs = [job]
                while True:  # every request that arrived while the last batch computed
                    try:
                        jobs.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._serve(jobs)

    async def _serve(self, jobs: list[EmbedJob]) -> None:
        try:
            vectors = await compute.run(functools.partial(self._compute, [ids for job in jobs for ids in job.inputs]))
        except Exception as exc:  # the requests' error, never the actor's
            for job in jobs:
                job.error = exc
        else:
            start = 0
            for job in jobs:
                job.vectors = vectors[start : start + len(job.inputs)]
                start += len(job.inputs)
        for job in jobs:
            job.done.set()

    def _compute(self, inputs: list[list[int]]) -> torch.Tensor:
        parts: list[Any] = [None] * len(inputs)
        for members in passes([len(ids) for ids in inputs], self.budget):
            self.passes += 1
            for i, vector in zip(members, embed_pass(self.model, [inputs[i] for i in members])):
                parts[i] = vector
        return torch.stack(parts)
