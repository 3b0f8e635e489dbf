"""What a generation stream yields."""

from __future__ import annotations

import attrs


@attrs.frozen
class TokenLogprob:
    """One generated token's logprob and its most likely alternatives."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen
class Chunk:
    """A piece of generated text; the last chunk of a stream has `done` and the counts and durations."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    done: bool = False
    done_reason: str | None = None  # "stop" or "length"
    prompt_eval_count: int = 0  # prompt tokens, reused ones included
    prompt_cached_count: int = 0  # of which were reused from the cache
    eval_count: int = 0
    prompt_eval_duration: int = 0  # nanoseconds
    eval_duration: int = 0
    total_duration: int = 0
    context: tuple[int, ...] = ()  # prompt + generated token ids (for /api/generate's `context`)
