"""DRY, "don't repeat yourself" (llama.cpp's, after Koboldcpp): penalise the token that would extend a
sequence already seen in the recent context, by `dry_multiplier * dry_base ^ (length - dry_allowed_length)`.

    options = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
               "dry_sequence_breakers": ["\\n", ":", "\\"", "*"]}

For every earlier position of the window (the last `dry_penalty_last_n` tokens, -1: the context, prompt
included), the length of the longest suffix of the context ending there; the token that followed it would
extend the repeat. Lengths stop at the last sequence breaker (a string: the tokens that spell it, found
through the vocabulary as llama.cpp finds them), and a token that is a breaker by itself is never penalised.
Ordered after penalties (15), before top-k, and active at temperature 0 like the penalties.

Vectorised over the batch and the window: each pass of the one loop extends every candidate match by one
token, and it stops when no match is left, or at the length past which the penalty no longer grows (the
exponent is clamped so the penalty stays a finite float32).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import attrs
import torch

from corral.hookspecs import hookimpl
from corral.options import Check, Options
from corral.sample import BatchParams, SequenceSampler

STATE = "dry.breakers"
MAX_BREAKER_CHARS = 40  # llama.cpp's limits on a breaker's text and on the tokens after its first
MAX_BREAKER_TAIL = 20
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: the penalty's exponent is clamped below it


@hookimpl
def register_samplers(register):
    register(Dry.name, Dry)


@attrs.frozen(eq=False)
class Breakers:
    """Sequence breakers as tokens: `tails[head]` lists the token sequences that complete a breaker begun by
    `head` (an empty tail: the head holds a whole breaker, `single`)."""

    tails: dict[int, tuple[tuple[int, ...], ...]]
    single: frozenset[int]

    @classmethod
    def of_tokens(cls, sequences: list[list[int]]) -> Breakers:
        """Breakers given as token sequences (llama.cpp's test form)."""
        tails: dict[int, set] = {}
        for head, *tail in sequences:
            tails.setdefault(head, set()).add(tuple(tail))
        return cls({head: tuple(sorted(found)) for head, found in tails.items()}, frozenset(h for h, t in tails.items() if () in t))

    def mask(self, tokens: set[int] | frozenset[int], width: int, device: torch.device) -> torch.Tensor:
        marked = torch.zeros(width, dtype=torch.bool, device=device)
        ids = [token for token in tokens if token < width]
        if ids:
            marked[torch.tensor(ids, device=device)] = True
        return marked


NO_BREAKERS = Breakers({}, frozenset())
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Breakers]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def breakers_for(tokenizer: Any, texts: tuple[str, ...]) -> Breakers:
    """The breakers `texts` in `tokenizer`'s tokens, computed once per tokenizer and set of texts.

    As llama.cpp: a token whose bytes contain a breaker is a whole breaker; a token that ends with the start
    of one is its head, followed by the tokens of the rest of it (at most MAX_BREAKER_TAIL)."""
    with _CACHE_LOCK:
        known = _CACHE.setdefault(tokenizer, {})
        if texts not in known:
            known[texts] = _scan_vocabulary(tokenizer, texts)
        return known[texts]


def _scan_vocabulary(tokenizer: Any, texts: tuple[str, ...]) -> Breakers:
    tails: dict[int, set] = {}
    words = [tokenizer.token_bytes(token) for token in range(tokenizer.vocab_size)]
    for text in texts:
        text = text[:MAX_BREAKER_CHARS]
        needle = text.encode()
        if not needle:
            continue
        rest_tokens: dict[int, tuple[int, ...]] = {}
        for token, word in enumerate(words):
            if needle in word:
                tails.setdefault(token, set()).add(())
                continue
            for overlap in range(1, min(len(word), len(needle))):
                if word.endswith(needle[:overlap]):
                    if overlap not in rest_tokens:
                        rest = needle[overlap:].decode(errors="replace")
                        rest_tokens[overlap] = tuple(tokenizer.encode(rest, add_special=False, parse_special=False)[:MAX_BREAKER_TAIL])
                    tails.setdefault(token, set()).add(rest_tokens[overlap])
    return Breakers({head: tuple(sorted(found)) for head, found in tails.items()}, frozenset(h for h, t in tails.items() if () in t))


def repeat_limit(window: list[int], breakers: Breakers) -> int:
    """How far back a repeat may reach: the number of tokens after the last breaker in `window` (all of them
    when there is none). A Python walk over the breaker heads only, from the end, stopping at the first."""
    for distance, token in enumerate(reversed(window)):
        tails = breakers.tails.get(token)
        if tails is None:
            continue
        # The tail follows the head: the tokens at distances distance-1, distance-2, ... from the end.
        after = window[len(window) - distance :]
        longest = max((len(tail) for tail in tails if len(tail) <= distance and tuple(after[: len(tail)]) == tail), default=-1)
        if longest >= 0:
            return distance - longest
    return len(window)


class Dry:
    """Subtract the DRY penalty from the tokens that would extend a repeat of at least dry_allowed_length."""

    name = "dry"
    order = 15
    options = {
        "dry_multiplier": (float, 0.0, Check(0.0)),
        "dry_base": (float, 1.75, Check(1.0)),
        "dry_allowed_length": (int, 2, Check(0)),
        "dry_penalty_last_n": (int, -1, Check(-1)),
        "dry_sequence_breakers": ("strings", ("\n", ":", '"', "*")),
    }

    @classmethod
    def active(cls, options: Options) -> bool:
        return options.get("dry_multiplier") > 0 and options.get("dry_penalty_last_n") != 0

    @staticmethod
    def window(options: Options, num_ctx: int | None) -> int:
        last_n = options.get("dry_penalty_last_n")
        return last_n if last_n > 0 else (num_ctx or options.num_ctx or 0)

    @staticmethod
    def prepare(sampler: SequenceSampler, tokenizer: Any) -> None:
        texts = tuple(sampler.options.get("dry_sequence_breakers"))
        sampler.state[STATE] = breakers_for(tokenizer, texts) if tokenizer is not None and texts else NO_BREAKERS

    def apply(self, logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
        allowed = params.tensor("dry_allowed_length")
        lengths = [seq.options.get("dry_penalty_last_n") for seq in params.seqs]
        tokens, valid = params.recent([n if n > 0 else None for n in lengths])
        breakers = [seq.state.get(STATE, NO_BREAKERS) for seq in params.seqs]
        limits = torch.tensor(
            [repeat_limit(seq.recent(n if n > 0 else None), found) for seq, n, found in zip(params.seqs, lengths, breakers)],
            device=logits.device,
        )
        # llama.cpp leaves a row alone when its window, or the reach of a repeat, is shorter than allowed.
        skip = (valid.sum(dim=-1) <= allowed) | (limits < allowed)
        if bool(skip.all()) or tokens.shape[1] < 2:
            return logits
        base = params.tensor("dry_base").double()
        most = torch.where(base > 1.000001, torch.floor(FLOAT_MAX_LOG / torch.log(base)), math.inf)
        longest = torch.minimum(limits, (allowed + most).clamp_max(tokens.shape[1]).long())
        repeats = match_lengths(tokens, valid, int(longest.max())).minimum(limits[:, None])
        # Each earlier position's next token would extend its repeat: the longest such repeat per token.
        vocab = logits.shape[1]
        follows = tokens[:, 1:]
        counts = (repeats >= allowed[:, None]) & valid[:, :-1] & (follows < vocab) & ~skip[:, None]
        slots = torch.where(counts, follows, vocab)
        best = torch.full((logits.shape[0], vocab + 1), -1, dtype=torch.int64, device=logits.device)
        best = best.scatter_reduce(1, slots, torch.where(counts, repeats, -1), reduce="amax")[:, :vocab]
        single = torch.stack([found.mask(found.single, vocab, logits.device) for found in breakers])
        hit = (best >= 0) & ~single
        exponent = torch.minimum((best - allowed[:, None]).double(), most[:, None])
        penalty = params.tensor("dry_multiplier").double()[:, None] * torch.pow(base[:, None], exponent)
        return torch.where(hit, logits - penalty.to(logits.dtype), logits)


def match_lengths(tokens: torch.Tensor, valid: torch.Tensor, longest: int) -> torch.Tensor:
    """For each position j < L-1 of each right-aligned row, how many tokens ending at j equal the row's last ones
    (the longest common suffix of tokens[:j+1] and tokens), up to `longest`: int64 [b, L-1]."""
    width = tokens.shape[1]
    alive = valid[:, :-1] & (tokens[:, :-1] == tokens[:, -1:])
    lengths = alive.long()
    offset = 1
    while offset < longest and bool(alive.any()):
        # Position j matches one further if tokens[j - offset] == tokens[L-1 - offset].
        same = valid[:, : width - 1 - offset] & (tokens[:, : width - 1 - offset] == tokens[:, width - 1 - offset : width - offset])
        alive = torch.cat([torch.zeros_like(alive[:, :offset]), alive[:, offset:] & same], dim=1)
        lengths += alive
        offset += 1
    return lengths
