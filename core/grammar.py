"""Constrained decoding with llguidance: a request's `format` becomes a grammar every sampled token must fit.

    grammar = compile_format("json")               # or a JSON-schema dict; InvalidFormatError when unusable
    matcher = GrammarMatcher.start(tokenizer, grammar)   # one per sequence
    mask_logits(logits, [matcher, ...])            # each row keeps only the tokens its grammar allows next
    matcher.accept(token); matcher.complete        # complete: the grammar admits no further token

The grammar sampler step (plugins/samplers/grammar.py) checks a drawn token with `allows` first and calls
`mask_logits` only when it is rejected (the chain's fast path, corral.sample); the sequence's sampler feeds
its matcher every accepted token, and the batching actor ends the sequence ("stop") once it is complete,
so the output is exactly one JSON value. End-of-generation tokens are allowed only where the grammar
could stop. Masks are computed by llguidance on CPU (all rows in parallel) and applied on the logits' device.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from corral.errors import CorralError

if TYPE_CHECKING:
    import llguidance
    import torch

    from corral.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compact, fixed separators: with free whitespace, small models can emit newlines until num_predict.
# A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A format that is a Lark grammar in llguidance's dialect rather than a schema: {LARK_KEY: "start: ..."}.
# corral's own tool calls use it (a forced call is the family's call text around JSON); it travels to a
# runner process as plain JSON like any other format.
LARK_KEY = "x-corral-lark"


class InvalidFormatError(CorralError):
    """A request's format is neither "json" nor a JSON schema that can be enforced."""


@attrs.frozen
class Grammar:
    """A compiled llguidance grammar (its serialized form) for one request format."""

    source: str


def compile_format(format: Any) -> Grammar | None:
    """The grammar for a request's `format`: "json" (any JSON object), a JSON-schema object, or None/"" (none)."""
    if format is None or format == "":
        return None
    if isinstance(format, dict) and set(format) == {LARK_KEY}:
        return _compile_lark(format[LARK_KEY])
    if format == "json":
        schema: Any = {"type": "object"}
    elif isinstance(format, dict):
        schema = format
    else:
        shown = repr(format)[:80]
        raise InvalidFormatError(f'format must be "json" or a JSON schema object, got {shown}')
    import llguidance  # here, as torch below: the routing server loads this native library only for a request with a format

    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidFormatError(f"format is not a usable JSON schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
    if is_error:
        raise InvalidFormatError(f"format is not a JSON schema corral can enforce: {messages[0]}")
    return Grammar(source)


def _compile_lark(text: Any) -> Grammar:
    if not isinstance(text, str):
        raise InvalidFormatError(f"{LARK_KEY} must be a Lark grammar string")
    import llguidance

    source = llguidance.LLMatcher.grammar_from_lark(text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
    if is_error:
        raise InvalidFormatError(f"the grammar cannot be enforced: {messages[0]}")
    return Grammar(source)


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads: every token's bytes (as corral decodes them), specials, encode."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_control(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (seconds for a large vocabulary)."""
    import llguidance

    with _LL_TOKENIZERS_LOCK:
        built = _LL_TOKENIZERS.get(tokenizer)
        if built is None:
            # Built from corral's own token bytes rather than the HF tokenizer's JSON: the GGUF-built
            # tokenizer has no HF decoder for llguidance to read the byte encoding from.
            eog = sorted(tokenizer.eog_ids) or None
            view = llguidance.TokenizerWrapper(_TokenizerView(tokenizer))
            built = _LL_TOKENIZERS[tokenizer] = llguidance.LLTokenizer(view, eos_token=eog)
        return built


class GrammarMatcher:
    """One sequence's place in its grammar: which tokens may come next, and whether the value is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @classmethod
    def start(cls, tokenizer: Tokenizer, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of `grammar` (builds the model's llguidance tokenizer on first use)."""
        import llguidance

        lltok = ll_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(lltok, grammar.source, log_level=0)
        if matcher.is_error():
            raise InvalidFormatError(f"format is not a JSON schema corral can enforce: {matcher.get_error()}")
        return cls(matcher, lltok.vocab_size)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (one token checked, no mask computed; nothing consumed)."""
        return self.matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> None:
        """Advance past a sampled token."""
        if not self.matcher.consume_token(token):
            # Only an unmasked draw can get here; the matcher then allows only end of generation.
            log.warning("grammar rejected token %d: %s", token, self.matcher.get_error())

    @property
    def complete(self) -> bool:
        """The grammar admits no further token (or failed): the sequence should end."""
        return self.matcher.is_stopped()


@functools.cache
def _executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()


@functools.cache
def _bit_shifts(device: torch.device) -> torch.Tensor:
    import torch

    return torch.arange(32, dtype=torch.int32, device=device)


def mask_logits(logits: torch.Tensor, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """`logits` [b, V] with every token that row b's matcher does not allow set to -inf, in place."""
    import llguidance.numpy
    import torch  # here, not at the top: the server compiles formats with this module and never imports torch

    vocab = matchers[0].vocab_size  # one model per runtime, so one tokenizer for every row
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab)
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(m.matcher, row) for row, m in enumerate(matchers)], bitmask)
    # llguidance.torch's apply is torch.compile'd (tens of seconds to compile on CPU): unpack the bits eagerly.
    words = torch.from_numpy(bitmask).to(logits.device)
    allowed = ((words[:, :, None] >> _bit_shifts(logits.device)) & 1).bool().flatten(1)
    width = min(vocab, logits.shape[1])
    logits[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    logits[:, width:] = float("-inf")  # the model's padding columns beyond the vocabulary are no tokens
    return logits
