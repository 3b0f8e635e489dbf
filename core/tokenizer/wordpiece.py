"""WordPiece (``bert``: BERT, BGE and other encoders).

Text is cleaned, lowercased and stripped of accents as the file's normalizer options say, split at
whitespace and punctuation, and each word is cut into the longest tokens from its start; a word
that cannot be cut whole is one unknown token. GGUF spells word-initial tokens with a leading "▁"
and continuations bare (Hugging Face: bare and "##"), so the vocabulary is renamed for the backend.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, models, normalizers, pre_tokenizers

from corral.tokenizer.pipeline import Pipeline
from corral.tokenizer.vocab import SPECIAL, SPIECE_SPACE, TokenizerError, Vocab

CONTINUATION = "##"


def wordpiece(vocab: Vocab, metadata: dict[str, Any]) -> Pipeline:
    """The WordPiece tokenizer of a ``bert`` file."""
    unk_id = vocab.special_id(metadata, "unknown", 100)
    if unk_id is None:
        raise TokenizerError("the model file's WordPiece tokenizer has no unknown token")
    renamed = {}
    for token_id, text in enumerate(vocab.tokens):
        if vocab.has(token_id, SPECIAL):
            renamed[text] = token_id
        elif text.startswith(SPIECE_SPACE):
            renamed[text[1:]] = token_id
        else:
            renamed[CONTINUATION + text] = token_id
    lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    return Pipeline(
        models.WordPiece(
            renamed,
            unk_token=vocab.tokens[unk_id],
            # llama.cpp has no length limit: any word is cut into tokens if it can be.
            max_input_chars_per_word=1 << 30,
            continuing_subword_prefix=CONTINUATION,
        ),
        normalizer=_normalizer(lowercase, strip_accents),
        pre_tokenizer=pre_tokenizers.BertPreTokenizer(),
        clean_spaces=True,
    )


def _normalizer(lowercase: bool, strip_accents: bool) -> normalizers.Normalizer:
    if not strip_accents:
        return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=lowercase)
    # llama.cpp strips accents its own way: each character becomes the first character of its
    # canonical decomposition, then every mark (not only non-spacing ones) goes. A Hangul syllable
    # so becomes its leading consonant: the 588 syllables of each consonant are one range.
    hangul = [
        normalizers.Replace(Regex(f"[\\x{{{first:X}}}-\\x{{{first + 587:X}}}]"), chr(0x1100 + lead))
        for lead, first in enumerate(range(0xAC00, 0xD7A4, 588))
    ]
    return normalizers.Sequence(
        [
            normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False),
            *hangul,
            normalizers.NFD(),
            normalizers.Replace(Regex(r"\p{M}"), ""),
            *([normalizers.Lowercase()] if lowercase else []),
        ]
    )
