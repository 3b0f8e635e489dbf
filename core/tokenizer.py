"""GGUF tokenizer metadata -> a `tokenizers.Tokenizer` that gives llama.cpp's token ids.

Two GGUF tokenizer models are supported:

* ``gpt2``: byte-level BPE with the file's merges and a regex pre-tokenizer chosen by
  ``tokenizer.ggml.pre`` (SmolLM, Llama 3, Qwen 2, ...).
* ``llama``: SentencePiece-style BPE (Llama 2, Gemma). The file has scores instead of merges;
  SentencePiece merges any adjacent pair whose concatenation is a token, best score first, so
  every split of a token into two tokens becomes a merge, ranked by the token's score. Characters
  that are not tokens fall back to ``<0xNN>`` byte tokens.

Control tokens (``<|im_start|>``, ``<start_of_turn>``) are parsed from text only with
``parse_special``; user-defined tokens (Gemma's runs of spaces, tabs and newlines) are always
parsed, as llama.cpp does. Decoding goes through `token_bytes`, one token at a time.
"""

from __future__ import annotations

import codecs
import enum
import functools
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from corral.errors import CorralError
from corral.gguf import GGUFFile

log = logging.getLogger(__name__)

SPIECE_SPACE = "\u2581"


class TokenizerError(CorralError):
    """The file's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@attrs.frozen
class PreTokenizer:
    """llama.cpp's regex pre-tokenizer for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_GPT2_PRE = PreTokenizer((_GPT2,))
_SMOLLM_PRE = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))

# Same groups as llama.cpp's llama-vocab.cpp; a name not here falls back to gpt2.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais"), _GPT2_PRE),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _SMOLLM_PRE
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_PRE),
}

# Control tokens that end a turn in the chat formats corral knows (llama.cpp's list, abridged).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    # The other bytes stand in as U+0100, U+0101, ... in byte order.
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


class Tokenizer:
    """Text <-> token ids for one GGUF model, matching llama.cpp's `llama_tokenize` token for token."""

    def __init__(
        self,
        backend: HFTokenizer,
        tokens: Sequence[str],
        types: Sequence[int],
        added: list[AddedToken],
        *,
        byte_level: bool,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
    ):
        self._backend = backend
        self._tokens = tokens
        self._types = types
        self._added = added
        self._byte_level = byte_level
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eog_ids = eog_ids
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._add_space_prefix = add_space_prefix
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (its `tokenizer.ggml.*` keys)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("the model file has no tokenizer.ggml.tokens; it cannot be tokenized")
        types = list(metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        # llama.cpp names empty tokens so that they cannot collide with real text.
        vocab_tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        vocab = {t: i for i, t in enumerate(vocab_tokens)}
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        unk_token = vocab_tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None

        if kind == "gpt2":
            pre = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
            model = _byte_level_bpe(vocab, metadata.get("tokenizer.ggml.merges") or [], pre)
            add_space_prefix = False
        elif kind == "llama":
            scores = metadata.get("tokenizer.ggml.scores")
            model = _sentencepiece_bpe(vocab, vocab_tokens, types, scores, unk_token)
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        else:
            raise TokenizerError(
                f"tokenizer model '{kind}' is not supported; corral reads 'gpt2' and 'llama' tokenizers"
            )

        backend = HFTokenizer(model)
        if kind == "gpt2":
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        else:
            steps = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
            backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
        added = _added_tokens(vocab_tokens, types)
        backend.add_tokens(added)

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            tokens,
            types,
            added,
            byte_level=kind == "gpt2",
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=_end_of_generation_ids(metadata, vocab, types),
            add_bos=adds_bos(metadata),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None,
            add_space_prefix=add_space_prefix,
        )

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id, if the model has one."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id, if the model has one."""
        return self._eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Token ids that end generation: EOS, EOT and end-of-turn control tokens."""
        return self._eog_ids

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    @property
    def add_bos(self) -> bool:
        """Whether `encode(add_special=True)` starts with BOS."""
        return self._add_bos

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added as the model asks when `add_special`."""
        backend = self._backend if parse_special else self._literal_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos:
            ids.insert(0, self._bos_id)
        if add_special and self._add_eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of token ids; bytes that are not valid UTF-8 become U+FFFD."""
        decoder = IncrementalDecoder(self, skip_special=skip_special)
        return "".join(map(decoder.feed, ids)) + decoder.flush()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token's text, nothing for an unused one)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def is_control(self, token_id: int) -> bool:
        """Whether `token_id` is a control token (BOS, EOS, turn markers), hidden by `skip_special`."""
        return self._types[token_id] == TokenType.CONTROL

    def _piece(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._tokens)} tokens")
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind == TokenType.UNUSED:
            return b""
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
            return text.encode()
        if kind == TokenType.BYTE and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:-1], 16)])
        if self._byte_level:
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in text)
        return text.replace(SPIECE_SPACE, " ").encode()

    @functools.cached_property
    def _literal_backend(self) -> HFTokenizer:
        # A second tokenizer over the same (shared) BPE model that reads control-token text as text.
        backend = HFTokenizer(self._backend.model)
        backend.normalizer = self._backend.normalizer
        backend.pre_tokenizer = self._backend.pre_tokenizer
        backend.add_tokens(self._added)
        backend.encode_special_tokens = True
        return backend


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back bytes of an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece models that prepend a space on encode drop it again from the first piece.
        self._strip_space = tokenizer._add_space_prefix

    def feed(self, token_id: int) -> str:
        """The text that token completes (possibly empty)."""
        if self._skip_special and self._tokenizer.is_control(token_id):
            return ""
        data = self._tokenizer.token_bytes(token_id)
        if self._strip_space and data:
            data = data.removeprefix(b" ")
            self._strip_space = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still held back, with U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file, which may hold a vocabulary only (no weights)."""
    gguf = GGUFFile.open(path)
    try:
        return Tokenizer.from_gguf(gguf.metadata)
    finally:
        gguf.close()


def adds_bos(metadata: dict[str, Any]) -> bool:
    """Whether the file's tokenizer starts encoded text with BOS: its flag, else llama.cpp's default."""
    if metadata.get("tokenizer.ggml.bos_token_id") is None:
        return False
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    kind = metadata.get("tokenizer.ggml.model")
    pre = PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre", "default"), _GPT2_PRE)
    return kind == "llama" or (kind == "gpt2" and pre.add_bos)


def _pre_tokenizer(name: str) -> PreTokenizer:
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        log.warning("unknown tokenizer.ggml.pre '%s'; splitting text with the GPT-2 regex", name)
        pre = _GPT2_PRE
    return pre


def _byte_level_bpe(vocab: dict[str, int], merges: Sequence[str], pre: PreTokenizer) -> models.BPE:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        return models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # tokenizers raises a bare Exception for merges outside the vocabulary
        raise TokenizerError(f"the model file's tokenizer merges do not fit its vocabulary: {exc}") from exc


def _sentencepiece_bpe(
    vocab: dict[str, int],
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float] | None,
    unk_token: str | None,
) -> models.BPE:
    score = np.asarray(scores if scores is not None else -np.arange(len(tokens)), dtype=np.float64)
    # User-defined tokens are cut out of the text before BPE runs, so no merge can produce one.
    score[np.asarray(types) == TokenType.USER_DEFINED] = -np.inf
    order = np.argsort(-score, kind="stable")
    merges = []
    for token in map(tokens.__getitem__, order[np.isfinite(score[order])].tolist()):
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    merges.append((left, right))
    return models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    """Control and unknown tokens as special tokens, user-defined ones as always-parsed tokens."""
    kinds = np.asarray(types)
    special = (kinds == TokenType.CONTROL) | (kinds == TokenType.UNKNOWN)
    ids = np.flatnonzero(special | (kinds == TokenType.USER_DEFINED)).tolist()
    # normalized=False: llama.cpp matches them against the raw text, before spaces become "▁".
    return [AddedToken(tokens[i], special=bool(special[i]), normalized=False) for i in ids]


def _end_of_generation_ids(
    metadata: dict[str, Any], vocab: dict[str, int], types: Sequence[int]
) -> frozenset[int]:
    ids = {metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")} - {None}
    for text in END_OF_TURN_TEXTS:
        token_id = vocab.get(text)
        if token_id is not None and types[token_id] in (TokenType.CONTROL, TokenType.USER_DEFINED):
            ids.add(token_id)
    return frozenset(ids)
