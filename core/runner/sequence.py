"""The sequence actor: one per request. It turns the batching actor's tokens into streamed text.

The actor owns everything text-level about its request: incremental detokenization (never a broken
UTF-8 character), stop strings (the stop text is not emitted, even when it spans tokens), logprobs,
and the final chunk with counts and durations.
"""

from __future__ import annotations

import time
from typing import Callable

import trio

from corral.runner.batching import Finished, Sampled, Sequence
from corral.runner.stop import StopMatcher
from corral.runner.stream import Chunk, TokenLogprob
from corral.tokenizer import IncrementalDecoder, Tokenizer


def truncate_prompt(ids: list[int], num_ctx: int, num_keep: int) -> list[int]:
    """Fit a prompt into the context: keep the first `num_keep` tokens and drop from the middle."""
    if len(ids) <= num_ctx:
        return ids
    keep = min(len(ids) if num_keep < 0 else num_keep, num_ctx - 1)  # -1: the whole prompt
    return ids[:keep] + ids[len(ids) - (num_ctx - keep) :]


class SequenceActor:
    """Streams one sequence's chunks into `out` until it finishes."""

    def __init__(
        self,
        seq: Sequence,
        tokenizer: Tokenizer,
        stops: tuple[str, ...],
        cached_count: int,
        want_logprobs: bool,
        resume: Callable[[], None],
    ):
        self.seq = seq
        self.resume = resume  # wakes the batching actor, which pauses a sequence whose reader lags
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = StopMatcher(stops)
        self.cached_count = cached_count
        self.want_logprobs = want_logprobs
        self.done_reason: str | None = None
        self.generated: list[int] = []

    async def run(self, events: trio.MemoryReceiveChannel, out: trio.MemorySendChannel) -> None:
        """Relay events as chunks; the last chunk carries done_reason and the metrics."""
        pending: list[Sampled] = []  # tokens whose text is still held back (partial UTF-8 or a possible stop)
        async for event in events:
            if isinstance(event, Finished):
                self.done_reason = event.reason
                break
            self.resume()
            self.generated.append(event.token)
            pending.append(event)
            text, stopped = self.stop.push(self.decoder.feed(event.token))
            if stopped:
                self.done_reason = "stop"
                await self._send_text(out, text, pending)
                await out.send(self._final_chunk())
                return
            if text:
                await self._send_text(out, text, pending)
                pending = []
        else:
            return  # the batching actor went away: the runtime is closing
        # Generation ended on its own: release held text unless it completes a stop string.
        text, stopped = self.stop.push(self.decoder.flush())
        await self._send_text(out, text if stopped else text + self.stop.flush(), pending)
        await out.send(self._final_chunk())

    async def _send_text(self, out: trio.MemorySendChannel, text: str, events: list[Sampled]) -> None:
        if not text and not events:
            return
        logprobs = tuple(self._logprob(e) for e in events) if self.want_logprobs else ()
        await out.send(Chunk(text=text, token_ids=tuple(e.token for e in events), logprobs=logprobs))

    def _logprob(self, event: Sampled) -> TokenLogprob:
        piece = self.tokenizer.decode
        top = tuple((token, piece([token]), logprob) for token, logprob in event.top)
        return TokenLogprob(event.token, piece([event.token]), event.logprob, top)

    def _final_chunk(self) -> Chunk:
        seq = self.seq
        end = time.perf_counter_ns()
        first = seq.first_token_ns or end
        return Chunk(
            done=True,
            done_reason=self.done_reason,
            prompt_eval_count=len(seq.prompt),
            prompt_cached_count=self.cached_count,
            eval_count=len(self.generated),
            prompt_eval_duration=first - seq.started_ns,
            eval_duration=max(0, (seq.last_token_ns or first) - first),
            total_duration=end - seq.started_ns,
            context=tuple(seq.prompt) + tuple(self.generated),
        )
