"""`Tokenizer`: text <-> token ids for one GGUF vocabulary, as llama.cpp's `llama_tokenize` gives them.

Encoding runs in a `tokenizers.Tokenizer` built once from the file: first the tokens that are cut
out of the raw text (user-defined ones always, control ones only with ``parse_special``), then the
tokenizer model's own normalizer, pre-tokenizer and model (bpe.py, spm.py, wordpiece.py,
unigram.py). Decoding joins each token's bytes as llama.cpp's `token_to_piece` gives them; it does
not clean up spaces around punctuation as llama.cpp's `llama_detokenize` does for BPE, so text that
BPE encodes decodes back to itself, and streaming (`IncrementalDecoder`) gives the same text as
`decode`. WordPiece is the exception: its pieces are words with a space in front, so `decode`
cleans them up as llama.cpp does (" hello , world" -> " hello, world"), and streaming gives the
pieces, as llama.cpp's `token_to_piece` does.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from corral.gguf import GGUFFile
from corral.tokenizer.bpe import byte_pair_encoding
from corral.tokenizer.pipeline import Pipeline
from corral.tokenizer.pretokenizers import PRE_TOKENIZERS
from corral.tokenizer.spm import sentencepiece_bpe
from corral.tokenizer.unigram import unigram
from corral.tokenizer.vocab import SPECIAL, SPIECE_SPACE, TokenAttr, TokenizerError, Vocab
from corral.tokenizer.wordpiece import wordpiece

# `tokenizer.ggml.model` -> the module that builds it.
MODELS: dict[str, Callable[[Vocab, dict[str, Any]], Pipeline]] = {
    "gpt2": byte_pair_encoding,
    "gemma4": byte_pair_encoding,
    "llama": sentencepiece_bpe,
    "bert": wordpiece,
    "t5": unigram,
}

# llama.cpp's defaults of tokenizer.ggml.add_bos_token / add_eos_token per tokenizer model (BPE's
# BOS default comes with its pre-tokenizer). WordPiece always frames the text in [CLS] ... [SEP].
_ADDS_BOS = {"llama": True, "bert": True, "t5": False, "gemma4": True}
_ADDS_EOS = {"bert": True, "t5": True}


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

    def __init__(self, vocab: Vocab, pipeline: Pipeline, metadata: dict[str, Any]):
        self._vocab = vocab
        self._pipeline = pipeline
        self._add_space_prefix = pipeline.add_space_prefix
        self._bos_id = _bos_id(metadata)
        kind = metadata.get("tokenizer.ggml.model")
        self._eos_id = vocab.special_id(metadata, "eos") if kind != "bert" else None
        # What encode(add_special=True) appends: EOS, or WordPiece's [SEP].
        self._end_id = vocab.special_id(metadata, "seperator", 102) if kind == "bert" else self._eos_id
        self._add_bos = adds_bos(metadata)
        self._add_eos = self._end_id is not None and bool(metadata.get("tokenizer.ggml.add_eos_token", _ADDS_EOS.get(kind, False)))
        self._eog_ids = frozenset(vocab.end_of_generation_ids(metadata))
        self._added = vocab.added_tokens()
        self._backend = self._new_backend(literal_special=False)
        self._id_map = self._backend_to_vocab_ids()
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (its `tokenizer.ggml.*` keys)."""
        kind = metadata.get("tokenizer.ggml.model")
        build = MODELS.get(kind)
        if build is None:
            raise TokenizerError(f"tokenizer model '{kind}' is not supported; corral reads {', '.join(map(repr, MODELS))} tokenizers")
        vocab = Vocab.from_metadata(metadata)
        return cls(vocab, build(vocab, metadata), metadata)

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
        """Token ids that end generation, as llama.cpp finds them: EOS, EOT and end-of-turn markers."""
        return self._eog_ids

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._vocab)

    @property
    def add_bos(self) -> bool:
        """Whether `encode(add_special=True)` starts with BOS."""
        return self._add_bos

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added as the model asks when `add_special`."""
        backend = self._backend if parse_special else self._literal_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        if self._id_map is not None and ids:
            ids = self._id_map[np.asarray(ids)].tolist()
        if add_special and self._add_bos:
            ids.insert(0, self._bos_id)
        if add_special and self._add_eos:
            ids.append(self._end_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of token ids; bytes that are not valid UTF-8 become U+FFFD."""
        decoder = IncrementalDecoder(self, skip_special=skip_special)
        text = "".join(map(decoder.feed, ids)) + decoder.flush()
        return _clean_spaces(text) if self._pipeline.clean_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token's text, nothing for an unused one)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def is_control(self, token_id: int) -> bool:
        """Whether `token_id` is a control token (BOS, EOS, turn markers)."""
        return self._vocab.has(token_id, TokenAttr.CONTROL)

    def is_hidden(self, token_id: int) -> bool:
        """Whether `decode(skip_special=True)` leaves `token_id` out: control and unknown tokens."""
        return self._vocab.has(token_id, SPECIAL)

    def _piece(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._vocab):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._vocab)} tokens")
        text = self._vocab.tokens[token_id]
        if self._vocab.has(token_id, SPECIAL | TokenAttr.USER_DEFINED):
            return text.encode()
        if self._vocab.has(token_id, TokenAttr.NORMAL):
            if self._pipeline.byte_level:
                table = _byte_decoder()
                return b"".join(bytes([table[c]]) if c in table else c.encode() for c in text)
            return text.replace(SPIECE_SPACE, " ").encode()
        if self._vocab.has(token_id, TokenAttr.BYTE) and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:-1], 16)])
        return b""

    def _new_backend(self, literal_special: bool) -> HFTokenizer:
        backend = HFTokenizer(self._pipeline.model)
        if self._pipeline.normalizer is not None:
            backend.normalizer = self._pipeline.normalizer
        if self._pipeline.pre_tokenizer is not None:
            backend.pre_tokenizer = self._pipeline.pre_tokenizer
        backend.add_tokens(self._added)
        # Reads control-token text as text; user-defined tokens are still cut out, as in llama.cpp.
        backend.encode_special_tokens = literal_special
        return backend

    @functools.cached_property
    def _literal_backend(self) -> HFTokenizer:
        return self._new_backend(literal_special=True)

    def _backend_to_vocab_ids(self) -> np.ndarray | None:
        # An added token whose text is not in the backend's (renamed) vocabulary gets a new id there.
        moved = {}
        for token in self._added:
            backend_id = self._backend.token_to_id(token.content)
            vocab_id = self._vocab.ids[token.content]
            if backend_id != vocab_id:
                moved[backend_id] = vocab_id
        if not moved:
            return None
        id_map = np.arange(max(len(self._vocab), max(moved) + 1))
        id_map[list(moved)] = list(moved.values())
        return id_map


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back bytes of an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Tokenizers that put a space in front of the text on encode drop it again from the first piece.
        self._strip_space = tokenizer._add_space_prefix

    def feed(self, token_id: int) -> str:
        """The text that token completes (possibly empty)."""
        if self._skip_special and self._tokenizer.is_hidden(token_id):
            return ""
        data = self._tokenizer.token_bytes(token_id)
        if self._strip_space and data:
            data = data.removeprefix(b" ")
            self._strip_space = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still held back, with U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)


def _clean_spaces(text: str) -> str:
    # llama.cpp's three passes, in order: " ," -> ",", " ' " -> "'", " 's" -> "'s" (and 'm 're 've).
    text = re.sub(r" (?=[?!.,])", "", text)
    text = text.replace(" ' ", "'")
    return re.sub(r" (?='(?:[sm]|re|ve))", "", text)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file, which may hold a vocabulary only (no weights)."""
    gguf = GGUFFile.open(path)
    try:
        return Tokenizer.from_gguf(gguf.metadata)
    finally:
        gguf.close()


def _bos_id(metadata: dict[str, Any]) -> int | None:
    kind = metadata.get("tokenizer.ggml.model")
    pre = PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre") or "default")
    if kind == "gpt2" and pre is not None and not pre.has_bos:
        return None
    # WordPiece's BOS is [CLS], 101 in BERT's vocabulary unless the file says otherwise.
    bos_id = metadata.get("tokenizer.ggml.bos_token_id", 101 if kind == "bert" else None)
    return bos_id if bos_id is not None and 0 <= bos_id < len(metadata.get("tokenizer.ggml.tokens") or ()) else None


def adds_bos(metadata: dict[str, Any]) -> bool:
    """Whether the file's tokenizer starts encoded text with BOS: its flag, else llama.cpp's default."""
    if _bos_id(metadata) is None:
        return False
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gemma4":
        return True  # llama.cpp adds Gemma 4's BOS whatever the flag says
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    if kind == "gpt2":
        pre = PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre") or "default")
        return pre is not None and pre.add_bos
    return _ADDS_BOS.get(kind, False)
