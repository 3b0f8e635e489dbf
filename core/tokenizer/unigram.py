"""Unigram (``t5``: T5, XLM-RoBERTa and the encoders built on them).

The text goes through the file's precompiled SentencePiece normalizer (NFKC and friends), spaces
become "▁" (runs of them one, with `tokenizer.ggml.remove_extra_whitespaces`), and the split with
the best total score wins (Viterbi). Only normal, user-defined and unused tokens take part in that
search, as in llama.cpp; the others get names no text can contain.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Regex, models, normalizers

from corral.tokenizer.pipeline import Pipeline
from corral.tokenizer.vocab import SPIECE_SPACE, TokenAttr, TokenizerError, Vocab

_SEARCHED = TokenAttr.NORMAL | TokenAttr.USER_DEFINED | TokenAttr.UNUSED
# Noncharacters: Unicode reserves them never to be exchanged as text.
_UNMATCHABLE = "\ufdd0{}\ufdd1"


def unigram(vocab: Vocab, metadata: dict[str, Any]) -> Pipeline:
    """The Unigram tokenizer of a ``t5`` file."""
    unk_id = vocab.special_id(metadata, "unknown", 2)
    if unk_id is None:
        raise TokenizerError("the model file's Unigram tokenizer has no unknown token")
    searched = (vocab.attrs & _SEARCHED) != 0
    normal = (vocab.attrs & TokenAttr.NORMAL) != 0
    scores = vocab.scores.copy()
    # User-defined tokens score 0 (llama.cpp); the unsearched ones must not lower the score the
    # backend gives an unknown character (the lowest score less 10, as in SentencePiece).
    scores[(vocab.attrs & TokenAttr.USER_DEFINED) != 0] = 0.0
    scores[~searched] = scores[normal].min() if normal.any() else 0.0
    pieces = [
        (text if searched[i] else _UNMATCHABLE.format(i), score) for i, (text, score) in enumerate(zip(vocab.tokens, scores.tolist()))
    ]
    return Pipeline(
        models.Unigram(pieces, unk_id=unk_id, byte_fallback=False),
        normalizer=normalizers.Sequence(_normalizer_steps(metadata)),
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
    )


def _normalizer_steps(metadata: dict[str, Any]) -> list[normalizers.Normalizer]:
    steps = []
    # One known difference from llama.cpp (and SentencePiece): this normalizer maps a whole grapheme
    # cluster by its first character, so a mapped character followed by a combining mark ("ﬁ" +
    # U+0308) loses the mark. llama.cpp maps the longest prefix and goes on with the rest.
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap):
        steps.append(normalizers.Precompiled((np.asarray(charsmap) & 0xFF).astype(np.uint8).tobytes()))
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", False):
        # Runs of spaces become one, spaces at either end go, and every word starts with "▁".
        steps += [
            normalizers.Replace(Regex(" +"), " "),
            normalizers.Replace(Regex(r"\A | \z"), ""),
            normalizers.Prepend(" "),
        ]
    elif metadata.get("tokenizer.ggml.add_space_prefix", False):
        steps.append(normalizers.Prepend(" "))
    steps.append(normalizers.Replace(" ", SPIECE_SPACE))
    return steps
