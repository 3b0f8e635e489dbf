"""BPE with merges: GPT-2's byte-level BPE (``gpt2``) and SentencePiece-style BPE (``gemma4``).

The text is split by the file's pre-tokenizer (pretokenizers.py), then each word is merged pair by
pair in the order of `tokenizer.ggml.merges`. Byte-level vocabularies spell every byte as one
printable character, so no text is unknown; the others fall back to ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import models, normalizers

from corral.tokenizer.pipeline import Pipeline
from corral.tokenizer.pretokenizers import pre_tokenizer
from corral.tokenizer.vocab import SPIECE_SPACE, TokenizerError, Vocab

log = logging.getLogger(__name__)


def byte_pair_encoding(vocab: Vocab, metadata: dict[str, Any]) -> Pipeline:
    """The BPE tokenizer of a ``gpt2`` or ``gemma4`` file."""
    if metadata.get("tokenizer.ggml.model") == "gemma4":
        pre = pre_tokenizer("gemma4")
    else:
        pre = pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None and metadata.get("tokenizer.ggml.pre") != "kimi-k2":
        raise TokenizerError("the model file's BPE tokenizer has no tokenizer.ggml.merges")
    model = models.BPE(
        vocab.ids,
        _merges(vocab.ids, merges or []),
        ignore_merges=pre.ignore_merges,
        byte_fallback=not pre.byte_level,
    )
    return Pipeline(
        model,
        normalizer=normalizers.Replace(" ", SPIECE_SPACE) if pre.escape_whitespace else None,
        pre_tokenizer=pre.backend(),
        byte_level=pre.byte_level,
    )


def _merges(ids: dict[str, int], merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs, dropped = [], 0
    for merge in merges:
        # Split at the first space after the first character, as llama.cpp does.
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in ids and right in ids and left + right in ids:
            pairs.append((left, right))
        else:
            dropped += 1
    if dropped:
        log.warning("%d of the model file's %d BPE merges do not fit its vocabulary; ignoring them", dropped, len(merges))
    return pairs
