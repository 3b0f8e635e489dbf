"""What each tokenizer model builds: the `tokenizers` pieces that encode, and how its tokens decode."""

from __future__ import annotations

import attrs
from tokenizers import models, normalizers, pre_tokenizers


@attrs.frozen
class Pipeline:
    """A `tokenizers` model with its normalizer and pre-tokenizer, and how its tokens read back."""

    model: models.Model
    normalizer: normalizers.Normalizer | None = None
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None
    # A normal token's text is GPT-2's byte-to-character mapping (else UTF-8 with "▁" for spaces).
    byte_level: bool = False
    # A space was put in front of the text on encode, so decoding drops the first one.
    add_space_prefix: bool = False
    # Decoding drops the spaces WordPiece puts before punctuation and contractions (" ," -> ",").
    clean_spaces: bool = False
