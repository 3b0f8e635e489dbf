"""A GGUF vocabulary: token texts, scores and the attributes llama.cpp gives each token.

GGUF stores one `tokenizer.ggml.token_type` per token; llama.cpp turns it into attribute flags and
then corrects them by token text, because converters mark some tokens wrongly: end-of-turn and
fill-in-the-middle markers become control tokens, gpt-oss's channel markers user-defined ones, and
Phi-3's special tokens swallow the whitespace after them. The attributes decide what is parsed from
plain text (user-defined tokens always, control tokens only with ``parse_special``) and how a token
decodes, so they are computed here once, the way llama.cpp computes them.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np
from tokenizers import AddedToken

from corral.errors import TokenizerError


SPIECE_SPACE = "\u2581"  # SentencePiece's stand-in for a space


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """llama.cpp's per-token attributes (`llama_token_attr`)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


SPECIAL = TokenAttr.CONTROL | TokenAttr.UNKNOWN
# Tokens cut out of the text before the tokenizer model sees it (control ones only when parsed).
MATCHED_IN_TEXT = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN

_ATTR_OF_TYPE = {
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}

# Texts llama.cpp treats as end of generation, whatever the file says their type is.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip

# Fill-in-the-middle markers by metadata key: looked up by text when the file has no id for them.
FILL_IN_THE_MIDDLE_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

# gpt-oss's harmony markers are always rendered and parsed, like user-defined tokens.
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@attrs.frozen
class Vocab:
    """Token texts (empty ones named ``[EMPTY_<id>]``), scores and llama.cpp attributes."""

    tokens: list[str]
    attrs: np.ndarray
    scores: np.ndarray
    ids: dict[str, int]

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Vocab:
        """The vocabulary of a file's `tokenizer.ggml.*` keys, with llama.cpp's attribute fixes."""
        raw = metadata.get("tokenizer.ggml.tokens")
        if not raw:
            raise TokenizerError("the model file has no tokenizer.ggml.tokens; it cannot be tokenized")
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(raw)]
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TokenType.NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) != len(tokens):
            raise TokenizerError("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length")
        flags = np.asarray([_ATTR_OF_TYPE.get(t, TokenAttr.UNDEFINED) for t in types], dtype=np.int32)
        # A later duplicate text wins, as in llama.cpp's text -> id map.
        vocab = cls(
            tokens,
            flags,
            np.asarray(scores if scores is not None else np.zeros(len(tokens)), dtype=np.float64),
            {t: i for i, t in enumerate(tokens)},
        )
        vocab._fix_attributes(metadata)
        return vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def has(self, token_id: int, attr: TokenAttr) -> bool:
        """Whether token `token_id` has any of the attribute flags `attr`."""
        return bool(self.attrs[token_id] & attr)

    def special_id(self, metadata: dict[str, Any], key: str, default: int | None = None) -> int | None:
        """`tokenizer.ggml.<key>_token_id`, or `default`; None when it is outside the vocabulary."""
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id", default)
        return token_id if token_id is not None and 0 <= token_id < len(self) else None

    def added_tokens(self) -> list[AddedToken]:
        """Tokens matched in the raw text before the model runs; control and unknown ones are special."""
        # llama.cpp cuts the longest tokens out first; the backend takes the leftmost longest match,
        # which is the same but where two such tokens overlap.
        return [
            AddedToken(
                self.tokens[i],
                special=self.has(i, SPECIAL),
                normalized=False,  # matched against the raw text, before any normalization
                lstrip=self.has(i, TokenAttr.LSTRIP),
                rstrip=self.has(i, TokenAttr.RSTRIP),
            )
            for i in np.flatnonzero(self.attrs & MATCHED_IN_TEXT).tolist()
        ]

    def end_of_generation_ids(self, metadata: dict[str, Any]) -> set[int]:
        """Ids llama.cpp stops at: EOS/EOT/EOM, the end-of-generation texts and FIM pad/repo/sep."""
        ids = self._end_of_generation_candidates(metadata)
        texts = {self.tokens[i] for i in ids}
        if _ends_messages_with_end(texts):
            ids.discard(self.ids["<|end|>"])
        if _has_normal_end_of_sentence(texts):
            ids.discard(self.ids["</s>"])
        return ids

    def _end_of_generation_candidates(self, metadata: dict[str, Any]) -> set[int]:
        ids = {self.special_id(metadata, key) for key in ("eos", "eot", "eom")}
        ids |= {self.ids[text] for text in END_OF_GENERATION_TEXTS if text in self.ids}
        ids |= {self._fill_in_the_middle_id(metadata, key) for key in ("fim_pad", "fim_rep", "fim_sep")}
        ids.discard(None)
        return ids

    def _fill_in_the_middle_id(self, metadata: dict[str, Any], key: str) -> int | None:
        token_id = self.special_id(metadata, key)
        if token_id is None:
            token_id = next((self.ids[t] for t in FILL_IN_THE_MIDDLE_TEXTS[key] if t in self.ids), None)
        return token_id

    def _set(self, text: str, attr: TokenAttr, value: bool = True) -> None:
        token_id = self.ids.get(text)
        if token_id is not None:
            self.attrs[token_id] = self.attrs[token_id] | attr if value else self.attrs[token_id] & ~attr

    def _fix_attributes(self, metadata: dict[str, Any]) -> None:
        # Markers llama.cpp finds by text are control tokens, whatever their stored type.
        for key, texts in FILL_IN_THE_MIDDLE_TEXTS.items():
            if self.special_id(metadata, key) is None:
                for text in texts:
                    self._set(text, TokenAttr.CONTROL)
        for text in END_OF_GENERATION_TEXTS:
            self._set(text, TokenAttr.CONTROL)
        control = np.flatnonzero(self.attrs & TokenAttr.CONTROL).tolist()
        self.attrs[[i for i in control if "unused" in self.tokens[i]]] |= TokenAttr.UNUSED
        for text in _ALWAYS_USER_DEFINED:
            if text in self.ids:
                self.attrs[self.ids[text]] = TokenAttr.USER_DEFINED
        texts = {self.tokens[i] for i in self._end_of_generation_candidates(metadata)}
        if _ends_messages_with_end(texts):
            self.attrs[self.ids["<|end|>"]] = TokenAttr.USER_DEFINED
        if _has_normal_end_of_sentence(texts):
            self.attrs[self.ids["</s>"]] = TokenAttr.NORMAL
        self._fix_attributes_by_model(metadata)

    def _fix_attributes_by_model(self, metadata: dict[str, Any]) -> None:
        # llama.cpp keys these on the model's name, pre-tokenizer or architecture.
        name = str(metadata.get("general.name", "")).lower()
        pre = str(metadata.get("tokenizer.ggml.pre", ""))
        arch = str(metadata.get("general.architecture", ""))
        if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
        ):
            self._set("<mask>", TokenAttr.LSTRIP)
        elif "phi-3" in name or "phi3" in name:
            self.attrs[np.flatnonzero(self.attrs & MATCHED_IN_TEXT)] |= TokenAttr.RSTRIP
            self._set("</s>", TokenAttr.RSTRIP)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                self._set(text, TokenAttr.RSTRIP, False)
        elif "modern-bert" in name:
            self._set("[MASK]", TokenAttr.LSTRIP)


def _ends_messages_with_end(texts: set[str]) -> bool:
    # Harmony (gpt-oss) and Solar end a message with <|end|> and go on with the next one.
    return "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts)


def _has_normal_end_of_sentence(texts: set[str]) -> bool:
    # Gemma 4 and PLaMo 2 use </s> as ordinary text.
    return "</s>" in texts and bool(texts & {"<|tool_response>", "<|plamo:eos|>"})
