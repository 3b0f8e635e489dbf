"""llama.cpp's BPE pre-tokenizers: how each `tokenizer.ggml.pre` value splits text into words.

Each type is a list of regexes applied one after the other: every regex splits each piece the
previous ones made into its matches and the stretches between them. The expressions are written as
llama.cpp *runs* them, for the `tokenizers` (Oniguruma) engine:

* llama.cpp replaces every codepoint outside ASCII by one byte per Unicode category before matching
  an expression with ``\\p{..}`` in it, so ``\\p{Lu}``, ``\\p{Ll}``, ... all mean ``\\p{L}`` there;
* its ``$`` is the end of the piece (Oniguruma's is the end of a line): written ``\\z`` here;
* its ``\\d`` is ASCII only: written ``[0-9]`` here;
* it matches a space outside ASCII (U+3000, ...) only as ``\\s``, never by a character class that
  lists it: such classes are written ``[...&&[^\\s]]`` here;
* a few types run hand-written splitters (Kimi-K2, AFMoE digit groups), given here as the regex
  they implement.
"""

from __future__ import annotations

import attrs
from tokenizers import Regex, pre_tokenizers

from corral.tokenizer.vocab import TokenizerError


@attrs.frozen
class PreTokenizer:
    """One `tokenizer.ggml.pre` type: its regexes and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a token is that token, whatever the merges say
    add_bos: bool = False  # the default of tokenizer.ggml.add_bos_token
    byte_level: bool = True  # GPT-2 byte-to-character mapping; False: raw UTF-8 and <0xNN> tokens
    escape_whitespace: bool = False  # spaces become "▁" before splitting (SentencePiece-style BPE)
    has_bos: bool = True  # False: the type has no BOS token (ChatGLM), whatever the file says

    def backend(self) -> pre_tokenizers.PreTokenizer:
        """The same splitting as a `tokenizers` pre-tokenizer (byte-level mapping included)."""
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.regexes]
        if self.byte_level:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


def _ranges(*pairs: tuple[int, int] | int) -> str:
    """A character class body from codepoints and (first, last) ranges."""
    parts = []
    for pair in pairs:
        first, last = pair if isinstance(pair, tuple) else (pair, pair)
        parts.append(f"\\x{{{first:X}}}" + (f"-\\x{{{last:X}}}" if last != first else ""))
    return "".join(parts)


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL
_QWEN35 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + "".join(f"|\\s{{{n}}}(?!\\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}"
)
_NEWLINE_RUNS = r"[^\n]+|[\n]+"
# llama.cpp's digit-group splitter: runs of digits cut into threes from the right, the first group
# staying with the text before it ("ab12345" -> "ab12", "345").
_DIGIT_GROUPS = r"\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_ASCII_PUNCT_WORD = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
_KANA_HAN = "[" + _ranges((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)) + "]+"
_DEEPSEEK3 = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPARK = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
# Upper-case-aware splitting, written with lookaheads llama.cpp's engine can run: a letter that is
# not a-z, then letters that are not A-Z.
_CASED = (
    r"[^\r\n\p{{L}}\p{{N}}]?((?=[{l}])([^a-z]))*((?=[{l}])([^A-Z]))+{c}"
    r"|[^\r\n\p{{L}}\p{{N}}]?((?=[{l}])([^a-z]))+((?=[{l}])([^A-Z]))*{c}"
)
_TEKKEN = _CASED.format(l=r"\p{L}", c="") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O_TAIL = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = _CASED.format(l=r"\p{L}", c=_CONTRACTIONS + "?") + _GPT4O_TAIL
_GRANITE_MULTI = _CASED.format(l=r"\p{L}\p{M}", c=_CONTRACTIONS + "?") + _GPT4O_TAIL
# llama.cpp reads \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all as \p{L} (see the module docstring).
_LETTERS_MARKS = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
_TINY_AYA = _LETTERS_MARKS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_YOUTU_CJK = (
    "[" + _ranges((0xAC00, 0xD7A3), (0x3131, 0x318E)) + "]+"
    "|[" + _ranges(0xFF01, 0x2026, 0x201C, 0x201D, 0x2018, 0x2019, 0x2014, 0xFF1A, 0xFF1B, 0xFF0C,
                   (0x3001, 0x303F), (0xFE30, 0xFE4F)) + "]+"
    "|[" + _ranges((0x3105, 0x312F)) + "]+|" + _KANA_HAN
)  # fmt: skip
_YOUTU = _LETTERS_MARKS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# DeepSeek LLM's word pattern: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, ... letters.
_DEEPSEEK_LETTERS = _ranges(
    (0x41, 0x5A), (0x61, 0x7A), 0xB5, (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), 0x37F, 0x386,
    (0x388, 0x38A), 0x38C, (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F),
    (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), 0x1F59, 0x1F5B, 0x1F5D,
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), 0x1FBE, (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), 0x2102,
    0x2107, (0x210A, 0x2113), 0x2115, (0x2119, 0x211D), 0x2124, 0x2126, 0x2128, (0x212A, 0x212D),
    (0x212F, 0x2134), 0x2139, (0x213C, 0x213F), (0x2145, 0x2149), 0x214E, (0x2183, 0x2184),
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3), (0xA640, 0xA66D),
    (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)  # fmt: skip
_DEEPSEEK_PUNCT = "[!-/:-~" + _ranges((0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002)) + r"&&[^\s]]"
_CJK_HANGUL = "[" + _ranges((0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)) + r"&&[^\s]]+"
_BLOOM = " ?[^(\\s|.,!?" + _ranges(0x2026, 0x3002, 0xFF0C, 0x3001, 0x0964, 0x06D4, 0x060C) + ")]+"
_AFMOE_CJK = "[" + _ranges(
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x8C48, 0xFAFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xFF65, 0xFF9F),
    (0x2F00, 0x2FDF), (0x0E40, 0x0E7F), (0x0E80, 0x0EFF), (0x1780, 0x17FF), (0x1000, 0x109F), (0xAA60, 0xAA7F),
    (0xA9E0, 0xA9FF), (0xAC00, 0xD7AF), (0x1100, 0x11FF),
) + "]+"  # fmt: skip
_HAN = _ranges(
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip
_KIMI_K2 = (
    f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_HAN}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER = PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_DEEPSEEK3_PRE = PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3))
_CHATGLM = PreTokenizer((_LLAMA3,), has_bos=False)
_GPT4O_PRE = PreTokenizer((_GPT4O,))
_SPM_STYLE = PreTokenizer((_NEWLINE_RUNS,), byte_level=False, escape_whitespace=True)

# Every `tokenizer.ggml.pre` value llama.cpp knows, grouped as llama.cpp groups them; and "gpt2",
# which corral's own tiny test files write (llama.cpp spells it "gpt-2").
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+|" + _TAIL),
                             ignore_merges=True),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    "jais-2": PreTokenizer((_JAIS2,)),
    "deepseek-llm": PreTokenizer(
        (r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", rf"\s?{_DEEPSEEK_PUNCT}+", r"\s+\z", _CJK_HANGUL, r"\p{N}+")
    ),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3_PRE),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _SPARK, r"\p{N}")),
    "youtu": PreTokenizer((_YOUTU_CJK, _YOUTU), ignore_merges=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"), _STARCODER
    ),
    **dict.fromkeys(
        ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
         "granite-docling"),
        _GPT2_PRE,
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open", "grok-2"),
        _QWEN2_PRE,
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
    "chatglm-bpe": _CHATGLM,
    **dict.fromkeys(("glm4", "glm5"), attrs.evolve(_CHATGLM, ignore_merges=True)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizer(
        ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
         r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
        add_bos=True,
    ),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_PRE),
    "granite-embed-multi-97m": PreTokenizer((_GRANITE_MULTI,), ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), PreTokenizer((_DIGIT_GROUPS, _TINY_AYA))),
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    "superbpe": PreTokenizer((r"\p{N}+", "(?=([0-9]{3})+(?![0-9]))")),
    **dict.fromkeys(
        ("bailingmoe", "bailingmoe2", "llada-moe"),
        PreTokenizer((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    ),
    "seed-coder": PreTokenizer(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "ufakzeka": PreTokenizer((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL,)),
    "afmoe": PreTokenizer((_DIGIT_GROUPS, _AFMOE_CJK, _DEEPSEEK3)),
    "laguna": PreTokenizer((_NEWLINE_RUNS, _QWEN2)),
    "exaone-moe": PreTokenizer(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
         r"|\s*[\r\n]|\s+(?!\S)|\s+",)
    ),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), _SPM_STYLE),
    "sarvam-moe": _SPM_STYLE,
    "whitespace": PreTokenizer((r"\S+",), byte_level=False),
}  # fmt: skip


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer a BPE file names; a file without one gets llama.cpp's default."""
    if name is None or name == "":
        return _DEFAULT
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise TokenizerError(
            f"tokenizer.ggml.pre '{name}' is not a pre-tokenizer corral (or llama.cpp) knows; "
            "the model's text would be split wrongly, so it is refused"
        )
    return pre
