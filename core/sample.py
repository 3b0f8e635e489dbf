"""The sampler chain: named steps from plugins, applied in logit space to a batch of rows, then a draw.

A step is a class registered through the `register_samplers` hook:

    class BanToken:
        order = 15                                  # its place in the chain, lowest first
        options = {"ban_token": (int, -1)}          # option keys it reads: (type, default)

        @classmethod
        def active(cls, options) -> bool:           # does this row need the step?
            return options.get("ban_token", -1) >= 0

        def apply(self, logits, params):            # [b, V] float32 -> [b, V]; mask with -inf
            return logits.scatter(1, params.tensor("ban_token")[:, None], float("-inf"))

`apply` only ever sees the rows for which `active` is true, and is skipped when no row needs it; it
may modify `logits` in place. A step that depends on a sequence's state rather than its options defines
`active_for(sampler)` instead (the grammar step: does the row's `SequenceSampler` carry a matcher?).
The built-in steps (plugins/samplers/) run in this order:

     0 grammar   5 logit_bias   10 penalties   15 dry   20 top_k   30 temperature   35 typical_p
    40 top_p    50 min_p        55 xtc         60 mirostat                        -> softmax, draw

The grammar step masks a constrained row before all of them, but it is deferred (see `sample`): a draw
it allows needs no mask. Mirostat, when on, replaces the truncating steps (top_k ... xtc) as in llama.cpp.

Per-sequence state: a step may define `window(options, num_ctx)` (how many recent tokens it reads),
`prepare(sampler, tokenizer)` (run once when the sequence starts: `SamplerChain.start`), and
`observe(final, ids, tokens, params)` (told the token each of its rows drew, to update state such as
mirostat's mu, kept in `SequenceSampler.state`). A step's random numbers come from the sequence's own
generator, `sampler.uniform(purpose)`, one per purpose per token.

Top-k, temperature, top-p and min-p follow Ollama's order, so the probability filters see the
distribution that is actually drawn from. Every step except penalties is inactive at temperature 0,
so a greedy row takes the argmax of the logits after penalties (and the grammar step, or any
third-party step, active for it).

Each sequence draws with its own `torch.Generator`, one uniform number per token, and inverts the
CDF of its own row: a seeded sequence gives the same tokens whatever else is in the batch.

Candidates: a step that leaves every row at most `keeps_at_most(params)` unmasked tokens and can
return them as `candidates(logits, params) -> (values, ids)` (top-k) lets the chain continue on
those candidates alone, [b, k] instead of [b, V], when every later
active step declares `by_value = True` (it reads and masks logits by value only, never by token id:
temperature, typical-p, top-p, min-p). The values, and the draw (which walks candidates in token-id
order either way), are the same as over the whole vocabulary; Ollama's defaults on a 262k
vocabulary cost ~1/8 of the time.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import attrs
import numpy as np
import torch

from corral.options import STANDARD_OPTIONS, InvalidOptionError, Options

if TYPE_CHECKING:
    from corral.grammar import GrammarMatcher

MAX_TOP_LOGPROBS = 20

_DTYPES = {int: torch.int64, float: torch.float32, bool: torch.bool}


class SequenceSampler:
    """The sampling state of one sequence: its options, random generator, recent tokens and its steps' own state."""

    def __init__(
        self,
        options: Options,
        prompt: Iterable[int] = (),
        num_ctx: int | None = None,
        grammar: GrammarMatcher | None = None,
        window: int = 0,
    ):
        self.options = options
        self.grammar = grammar  # the request's format, followed from the first generated token
        self.generator = torch.Generator()
        seed = options.seed if options.seed >= 0 else int.from_bytes(os.urandom(8), "little")
        self.generator.manual_seed(seed % 2**64)
        # The penalty window, as llama.cpp's server fills it: prompt tokens, then generated ones. `window`: a
        # longer one a step asks for (DRY's dry_penalty_last_n), kept in the same deque.
        self.penalty_window = options.repeat_last_n if options.repeat_last_n >= 0 else (num_ctx or options.num_ctx)  # None: all
        maxlen = None if self.penalty_window is None else max(self.penalty_window, window)
        self.tokens: collections.deque[int] = collections.deque(prompt, maxlen=maxlen)
        self.state: dict[str, Any] = {}  # owned by the steps, under their names (mirostat's mu, DRY's breakers)
        self._uniforms: dict[str, float] = {}

    @property
    def history(self) -> list[int]:
        """The penalty window: the last `repeat_last_n` tokens, prompt included."""
        return self.recent(self.penalty_window)

    def recent(self, n: int | None) -> list[int]:
        """The last `n` tokens (None: all kept; fewer at the start), prompt included."""
        if n is not None and n <= 0:
            return []
        if n is None or n >= len(self.tokens):
            return list(self.tokens)
        return list(itertools.islice(self.tokens, len(self.tokens) - n, None))

    def accept(self, token: int) -> None:
        """Record a generated token in the penalty window and advance the grammar past it."""
        self.tokens.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    @property
    def complete(self) -> bool:
        """Its grammar admits no further token: the output is one whole value and the sequence should end."""
        return self.grammar is not None and self.grammar.complete

    def next_token(self) -> None:
        """Start choosing a new token: the uniform draws of the last one are forgotten."""
        self._uniforms.clear()

    def uniform(self, purpose: str = "draw") -> float:
        """One draw from U[0, 1) of this sequence's own generator for `purpose` (the draw, XTC's coin, ...).

        The same value for the whole of one token's sampling: when the grammar rejects a draw and the chain
        samples again under the mask (see SamplerChain.sample), it reuses the numbers of the first pass, so a
        seeded sequence consumes its generator the same way whatever else is in its batch."""
        if purpose not in self._uniforms:
            self._uniforms[purpose] = torch.rand((), generator=self.generator, dtype=torch.float64).item()
        return self._uniforms[purpose]


class BatchParams:
    """Per-row options and token history of the rows a step is applied to, as tensors on the logits' device."""

    def __init__(self, seqs: Sequence[SequenceSampler], device: torch.device, fields: dict[str, tuple[type, Any]]):
        self.seqs = seqs
        self.device = device
        self.fields = fields
        self._tensors: dict[str, torch.Tensor] = {}
        self._history: torch.Tensor | None = None

    @property
    def options(self) -> list[Options]:
        return [seq.options for seq in self.seqs]

    def tensor(self, name: str) -> torch.Tensor:
        """Option `name` of every row: [b], int64 / float32 / bool after the option's type."""
        if name not in self._tensors:
            kind, default = self.fields.get(name, (None, None))[:2]
            values = [seq.options.get(name, default) for seq in self.seqs]
            self._tensors[name] = torch.tensor(values, dtype=_DTYPES.get(kind), device=self.device)
        return self._tensors[name]

    @property
    def history(self) -> torch.Tensor:
        """Each row's penalty window (last `repeat_last_n` tokens, prompt included): int64 [b, L], padded with -1."""
        if self._history is None:
            length = max((len(seq.history) for seq in self.seqs), default=0)
            rows = np.full((len(self.seqs), length), -1, dtype=np.int64)
            for row, seq in enumerate(self.seqs):
                rows[row, : len(seq.history)] = seq.history
            self._history = torch.from_numpy(rows).to(self.device)
        return self._history

    def recent(self, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's last `lengths[row]` tokens, right-aligned: (int64 [b, L] padded with -1 on the left, bool valid)."""
        windows = [seq.recent(n) for seq, n in zip(self.seqs, lengths)]
        width = max((len(window) for window in windows), default=0)
        rows = np.full((len(self.seqs), width), -1, dtype=np.int64)
        for row, window in enumerate(windows):
            if window:
                rows[row, width - len(window) :] = window
        tokens = torch.from_numpy(rows).to(self.device)
        return tokens, tokens >= 0

    def select(self, rows: list[int]) -> BatchParams:
        """The parameters of a subset of the rows."""
        return BatchParams([self.seqs[row] for row in rows], self.device, self.fields)


def sorted_candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unmasked logits of each row, largest first: (values, token ids), both [b, n].

    n is the largest number of unmasked tokens in any row, so after top-k this is a small topk,
    and only a row without top-k costs a sort of the whole vocabulary. Shorter rows are padded with -inf.
    """
    n = int((logits > float("-inf")).sum(dim=-1).max())
    return torch.topk(logits, max(n, 1), dim=-1)


def scatter_candidates(like: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logits shaped like `like` holding `values` at `ids` where `keep`, -inf everywhere else."""
    masked = values.masked_fill(~keep, float("-inf"))
    return torch.full_like(like, float("-inf")).scatter_(1, ids, masked)


@attrs.frozen
class SampleResult:
    """The chosen token of each row, its logprob, and the top alternatives asked for."""

    tokens: list[int]
    logprobs: list[float]  # log-softmax of the raw logits at the chosen token
    top_logprobs: list[list[tuple[int, float]]]  # per row, the N most likely (token, logprob), best first


class SamplerChain:
    """The registered sampler steps, ordered; samples a batch of logits rows for their sequences."""

    def __init__(self, plugins):
        named = sorted(plugins.samplers().items(), key=lambda item: (item[1].order, item[0]))
        self.steps = [(name, cls()) for name, cls in named]
        self.fields: dict[str, tuple[type, Any]] = {
            name: (field.metadata["kind"], field.default) for name, field in STANDARD_OPTIONS.items()
        }
        for _name, step in self.steps:
            for key, spec in getattr(step, "options", {}).items():
                self.fields.setdefault(key, spec)

    def start(
        self, options: Options, prompt: Sequence[int] = (), num_ctx: int | None = None, grammar: GrammarMatcher | None = None,
        tokenizer: Any = None,
    ) -> SequenceSampler:
        """A new sequence's sampler; the steps active for it prepare their state (they may raise InvalidOptionError).

        A step may define `window(options, num_ctx) -> int`, the number of recent tokens it reads, and
        `prepare(sampler, tokenizer)`, run once per sequence (off the event loop: it may be slow once per model)."""
        probe = SequenceSampler(options, (), num_ctx, grammar)
        active = [step for _, step in self.steps if _active(step, probe)]
        window = max((step.window(options, num_ctx) for step in active if hasattr(step, "window")), default=0)
        sampler = SequenceSampler(options, prompt, num_ctx, grammar, window=window)
        for step in active:
            if hasattr(step, "prepare"):
                step.prepare(sampler, tokenizer)
        return sampler

    @property
    def extra_options(self) -> dict[str, tuple[type, Any]]:
        """The options the steps declare beyond Ollama's: pass them to `parse_options`."""
        return {name: spec for name, spec in self.fields.items() if name not in STANDARD_OPTIONS}

    def process(self, logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
        """Run every step over the rows that need it: the final logits [B, V], -inf where masked."""
        values, ids, _active_rows = self._candidates(logits, seqs)
        if ids is None:
            return values.clone() if values is logits else values  # never the caller's own tensor
        return torch.full(logits.shape, float("-inf"), device=values.device).scatter_(1, ids, values)

    def _candidates(
        self, logits: torch.Tensor, seqs: Sequence[SequenceSampler], defer: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[list[int]]]:
        """The final logits [B, V] and None; or, once a step narrowed every row, the final logits of
        the candidates [B, k] and their token ids. Also each step's active rows. `defer`: leave out the
        steps that can check a drawn token instead (`allows`: the grammar)."""
        active = [
            [] if defer and hasattr(step, "allows") else [row for row, seq in enumerate(seqs) if _active(step, seq)]
            for _, step in self.steps
        ]
        # Steps may change their rows in place: they get a copy. With none active (greedy rows
        # without penalties) the logits are read as they are.
        out = logits.to(torch.float32, copy=True) if any(active) else logits.float()
        params = BatchParams(seqs, out.device, self.fields)
        ids = None
        for index, ((_name, step), rows) in enumerate(zip(self.steps, active)):
            if ids is None and len(rows) == len(seqs) and self._narrows(step, index, active, params, out.shape[1]):
                out, ids = step.candidates(out, params)
            elif len(rows) == len(seqs):
                out = step.apply(out, params)
            elif rows:
                out[_index(rows, out)] = step.apply(_rows(out, rows), params.select(rows))
        return out, ids, active

    def _narrows(self, step: Any, index: int, active: list[list[int]], params: BatchParams, vocab: int) -> bool:
        """Whether the chain goes on over the candidates after `step` (the index-th, active on every row)."""
        keeps = getattr(step, "keeps_at_most", None)
        if keeps is None or not hasattr(step, "candidates") or keeps(params) * 8 > vocab:
            return False
        later = [later_step for (_, later_step), rows in zip(self.steps[index + 1 :], active[index + 1 :]) if rows]
        return all(getattr(later_step, "by_value", False) for later_step in later)

    def probabilities(self, logits: torch.Tensor, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
        """The distribution each row draws from, [B, V]; one-hot at the argmax for greedy rows."""
        final = self.process(logits, seqs)
        probs = torch.softmax(final, dim=-1)
        greedy = torch.tensor([seq.options.temperature == 0 for seq in seqs], device=final.device)
        one_hot = torch.zeros_like(probs).scatter_(1, final.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where(greedy[:, None], one_hot, probs)

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[SequenceSampler], top_logprobs: list[int] | None = None, logprobs: bool = True
    ) -> SampleResult:
        """Choose one token per row of `logits` [B, V]; row i belongs to `seqs[i]` (not accepted into it).
        Without `logprobs` (and top_logprobs), the chosen tokens' logprobs are NaN: not computed.

        The grammar's fast path, as Ollama's and llama.cpp's samplers take it: every row is first drawn
        without the steps that can check one token (`allows`: the grammar); only the rows whose token such
        a step rejects are sampled again with their full mask, reusing the same uniform numbers. A greedy
        row gets the constrained argmax either way; a sampled row's accepted draws skip the mask."""
        raw = logits.float()
        for seq in seqs:
            seq.next_token()
        checks = [(step, [row for row, seq in enumerate(seqs) if _active(step, seq)]) for _, step in self.steps if hasattr(step, "allows")]
        checks = [(step, rows) for step, rows in checks if rows]
        final, ids, active = self._candidates(raw, seqs, defer=bool(checks))
        tokens = self._draw(final, ids, seqs)
        drawn = tokens.tolist() if checks else []  # one transfer for every row's check, not a device sync per row
        rejected = sorted({row for step, rows in checks for row in rows if not step.allows(seqs[row], drawn[row])})
        self._observe(final, ids, tokens, seqs, active, skip=set(rejected))
        if rejected:
            again = [seqs[row] for row in rejected]
            final, ids, active = self._candidates(raw[_index(rejected, raw)], again)
            redrawn = self._draw(final, ids, again)
            self._observe(final, ids, redrawn, again, active)
            tokens[_index(rejected, tokens)] = redrawn
        if not logprobs and not any(top_logprobs or ()):
            return SampleResult(tokens.tolist(), [math.nan] * len(seqs), [[] for _ in seqs])
        norm = torch.logsumexp(raw, dim=-1)
        chosen = raw.gather(1, tokens[:, None])[:, 0] - norm
        return SampleResult(tokens.tolist(), chosen.tolist(), _alternatives(raw, norm, top_logprobs))

    def _observe(
        self, final: torch.Tensor, ids: torch.Tensor | None, tokens: torch.Tensor, seqs: Sequence[SequenceSampler],
        active: list[list[int]], skip: set[int] = frozenset(),
    ) -> None:
        """Tell the steps that keep per-sequence state (`observe`: mirostat's mu) which token each of their rows drew
        from the final distribution `final` (of candidates `ids`, or of the whole vocabulary)."""
        params = BatchParams(seqs, final.device, self.fields)
        for (_name, step), rows in zip(self.steps, active):
            rows = [row for row in rows if row not in skip]
            if rows and hasattr(step, "observe"):
                candidates = None if ids is None else _rows(ids, rows)
                step.observe(_rows(final, rows), candidates, tokens[_index(rows, tokens)], params.select(rows))

    def _draw(self, final: torch.Tensor, ids: torch.Tensor | None, seqs: Sequence[SequenceSampler]) -> torch.Tensor:
        """Each row's token: the argmax for greedy rows, else the inverse CDF at the row's own uniform number."""
        if ids is not None:  # candidates in token-id order: ties resolve as over the whole vocabulary
            ids, order = ids.sort(dim=-1)
            final = final.gather(1, order)
        tokens = torch.zeros(len(seqs), dtype=torch.int64, device=final.device)
        greedy = [row for row, seq in enumerate(seqs) if seq.options.temperature == 0]
        if greedy:
            best = row_argmax(_rows(final, greedy))
            tokens[_index(greedy, final)] = best if ids is None else _rows(ids, greedy).gather(1, best[:, None])[:, 0]
        drawn = [row for row, seq in enumerate(seqs) if seq.options.temperature > 0]
        if drawn:
            # Each row's draw uses only its own generator and its own probabilities.
            u = torch.tensor([seqs[row].uniform() for row in drawn], dtype=torch.float64, device=final.device)
            tokens[_index(drawn, final)] = inverse_cdf(_rows(final, drawn), u, None if ids is None else _rows(ids, drawn))
        return tokens


ARGMAX_BLOCK = 256


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first of tied maxima), in two stages over a large vocabulary: the first
    block holding the row's maximum, then its first maximum (measured: BENCHMARKS.md, core/sample.py)."""
    rows, width = x.shape
    if width % ARGMAX_BLOCK or width < 16 * ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    blocks = x.view(rows, width // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block = blocks.amax(dim=-1).argmax(dim=-1)
    return block * ARGMAX_BLOCK + blocks[torch.arange(rows, device=x.device), block].argmax(dim=-1)


def inverse_cdf(logits: torch.Tensor, u: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """For each row, the token whose interval of the CDF of softmax(logits) holds u in [0, 1): int64 [b].
    `ids`: the token id of each column, ascending, when `logits` holds candidates, not the whole
    vocabulary."""
    if ids is not None:
        values = logits  # walked in the order of `ids`, which the chain keeps by token id
    else:
        width = int((logits > float("-inf")).sum(dim=-1).max())
        if 2 * width > logits.shape[1]:  # mostly unmasked: walk the whole row, no sort needed
            values, ids = logits, torch.arange(logits.shape[1], device=logits.device).expand_as(logits)
        else:
            values, ids = torch.topk(logits, max(width, 1), dim=-1)
            # Walk the candidates in token-id order, as the whole-row walk does: tied logits then
            # cannot be ordered differently when the batch (and so the candidates' width) changes.
            ids, order = ids.sort(dim=-1)
            values = values.gather(1, order)
    top = values.max(dim=-1, keepdim=True).values
    weights = torch.exp(values.double() - top.double())
    cdf = weights.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    # Rounding can put u * total at the very end: never step past the last token with mass.
    positions = torch.arange(weights.shape[1], device=logits.device)
    last = torch.where(weights > 0, positions, 0).max(dim=-1, keepdim=True).values
    return ids.gather(1, torch.minimum(picked, last))[:, 0]


def _active(step: Any, seq: SequenceSampler) -> bool:
    active_for = getattr(step, "active_for", None)
    return active_for(seq) if active_for is not None else step.active(seq.options)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=like.device)


def _rows(batch: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return batch if len(rows) == batch.shape[0] else batch[_index(rows, batch)]


def _alternatives(raw: torch.Tensor, norm: torch.Tensor, counts: list[int] | None) -> list[list[tuple[int, float]]]:
    counts = counts or [0] * raw.shape[0]
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidOptionError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {n!r}")
    widest = min(max(counts, default=0), raw.shape[1])
    if widest == 0:
        return [[] for _ in counts]
    values, ids = torch.topk(raw, widest, dim=-1)
    logprobs = (values - norm[:, None]).tolist()
    ids = ids.tolist()
    return [list(zip(ids[row][:n], logprobs[row][:n])) for row, n in enumerate(counts)]
