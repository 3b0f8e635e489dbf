"""SentencePiece BPE (``llama``: Llama 2, Gemma, Phi-3, Baichuan).

The file has scores instead of merges. SentencePiece merges any adjacent pair whose concatenation is
a token, best score first, so every split of a token into two tokens becomes a merge ranked by the
token's score. Characters that are not tokens fall back to ``<0xNN>`` byte tokens. Spaces become
"▁", and a space is put in front of the text unless `tokenizer.ggml.add_space_prefix` is false.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import models, normalizers

from corral.tokenizer.pipeline import Pipeline
from corral.tokenizer.vocab import SPIECE_SPACE, Vocab


def sentencepiece_bpe(vocab: Vocab, metadata: dict[str, Any]) -> Pipeline:
    """The SentencePiece BPE tokenizer of a ``llama`` file."""
    scores = vocab.scores if metadata.get("tokenizer.ggml.scores") is not None else -np.arange(len(vocab))
    merges = []
    for token in map(vocab.tokens.__getitem__, np.argsort(-scores, kind="stable").tolist()):
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab.ids:
                right = token[cut:]
                if right in vocab.ids:
                    merges.append((left, right))
    unk_id = vocab.special_id(metadata, "unknown", 0)
    model = models.BPE(
        vocab.ids,
        merges,
        unk_token=vocab.tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    return Pipeline(
        model,
        normalizer=normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)]),
        add_space_prefix=add_space_prefix,
    )
