"""Tokenizers built from GGUF metadata give llama.cpp's ids and decode back to the text."""

from __future__ import annotations

import pytest
from conftest import reference_tokens

from corral.gguf import GGUFFile
from corral.plugins.architectures.gemma3 import Gemma3Model
from corral.template import ChatTemplate
from corral.tokenizer import PRE_TOKENIZERS, IncrementalDecoder, Tokenizer, TokenizerError
from corral.tokenizer.codec import _byte_decoder

MODELS = ("smollm2", "gemma3")
MULTIBYTE_TEXTS = ["café naïve résumé", "🤷🏽‍♀️ ok 👍🏿", "日本語の文と한국어", "Ünïcödé ✓ ∑ 𝔘"]


def reference_cases() -> list:
    """Every reference entry; a repeated (text, add_special) pair was made with parse_special=False."""
    cases = []
    for model in MODELS:
        seen = set()
        for index, entry in enumerate(reference_tokens(model)):
            key = (entry["text"], entry["add_special"])
            cases.append(pytest.param(model, entry, key not in seen, id=f"{model}-{index}"))
            seen.add(key)
    return cases


@pytest.fixture(scope="session")
def metadata_for(smollm2_path, gemma3_path):
    """Each real model's GGUF metadata, read once per session."""
    paths = {"smollm2": smollm2_path, "gemma3": gemma3_path}
    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            gguf = GGUFFile.open(paths[model])
            cache[model] = gguf.metadata
            gguf.close()
        return cache[model]

    return get


@pytest.fixture(scope="session")
def tokenizer_for(metadata_for):
    """Each real model's tokenizer, built once per session."""
    cache: dict[str, Tokenizer] = {}

    def get(model: str) -> Tokenizer:
        if model not in cache:
            cache[model] = Tokenizer.from_gguf(metadata_for(model))
        return cache[model]

    return get


@pytest.mark.parametrize(("model", "entry", "parse_special"), reference_cases())
def test_encode_gives_llama_cpp_ids(tokenizer_for, model, entry, parse_special):
    tokenizer = tokenizer_for(model)
    ids = tokenizer.encode(entry["text"], add_special=entry["add_special"], parse_special=parse_special)
    assert ids == entry["ids"]


@pytest.mark.parametrize(("model", "entry", "parse_special"), reference_cases())
def test_decode_round_trips_reference_text(tokenizer_for, model, entry, parse_special):
    tokenizer = tokenizer_for(model)
    ids = tokenizer.encode(entry["text"], add_special=False, parse_special=parse_special)
    assert tokenizer.decode(ids) == entry["text"]


# End of generation as llama.cpp finds it: EOS and the end-of-turn texts, which include smollm2's
# <reponame> (4, fill-in-the-middle "repo") and gemma3's </s> (212).
@pytest.mark.parametrize(
    ("model", "bos", "eos", "eog", "add_bos", "vocab_size"),
    [("smollm2", 1, 2, {0, 2, 4}, False, 49152), ("gemma3", 2, 1, {1, 106, 212}, True, 262144)],
)
def test_special_token_properties_come_from_metadata(tokenizer_for, model, bos, eos, eog, add_bos, vocab_size):
    tokenizer = tokenizer_for(model)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eog_ids) == (bos, eos, frozenset(eog))
    assert (tokenizer.add_bos, tokenizer.vocab_size) == (add_bos, vocab_size)


@pytest.mark.parametrize(
    ("model", "text", "pieces"),
    [
        ("gemma3", "🦙", ["", "", "", "🦙"]),  # four byte-fallback tokens
        ("smollm2", "🦙", ["", "", "🦙"]),
        ("gemma3", "日本語の文", ["日本語", "の", "文"]),
    ],
)
def test_incremental_decoder_holds_back_partial_characters(tokenizer_for, model, text, pieces):
    tokenizer = tokenizer_for(model)
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.feed(i) for i in tokenizer.encode(text, add_special=False)] == pieces
    assert decoder.flush() == ""


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_decoder_equals_decode_token_by_token(tokenizer_for, model, text):
    tokenizer = tokenizer_for(model)
    ids = tokenizer.encode(text, add_special=False)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_decoder_flushes_an_unfinished_character_as_replacement(tokenizer_for):
    tokenizer = tokenizer_for("gemma3")
    decoder = IncrementalDecoder(tokenizer)
    first_byte = tokenizer.encode("🦙", add_special=False)[0]
    assert decoder.feed(first_byte) == ""
    assert decoder.flush() == "\ufffd"


def test_gemma_chat_prompt_encodes_with_exactly_one_bos(metadata_for, tokenizer_for):
    template = ChatTemplate.from_metadata(metadata_for("gemma3"), Gemma3Model.default_chat_template())
    text = template.render([{"role": "user", "content": "Hi"}])
    ids = tokenizer_for("gemma3").encode(text, add_special=True)
    assert ids == [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]


def test_skip_special_drops_control_tokens_only(tokenizer_for):
    tokenizer = tokenizer_for("gemma3")
    ids = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert tokenizer.decode(ids) == "<bos><start_of_turn>user\nHi<end_of_turn>"
    assert tokenizer.decode(ids, skip_special=True) == "user\nHi"


@pytest.mark.parametrize(("model", "text", "expected"), [("gemma3", "🦙", b"\xf0"), ("smollm2", " ", b" ")])
def test_token_bytes_are_raw_bytes(tokenizer_for, model, text, expected):
    tokenizer = tokenizer_for(model)
    assert tokenizer.token_bytes(tokenizer.encode(text, add_special=False)[0]) == expected


def test_gemma_end_of_sentence_is_parsed_only_as_special_text(tokenizer_for):
    # gemma3's </s> is user-defined, but llama.cpp makes it a control (end-of-generation) token, so
    # plain text does not parse it; <table>, also user-defined, is parsed from any text.
    tokenizer = tokenizer_for("gemma3")
    assert 212 in tokenizer.encode("a</s>b", parse_special=True)
    assert 212 not in tokenizer.encode("a</s>b", parse_special=False)
    assert 168 in tokenizer.encode("a<table>b", parse_special=False)


def test_token_bytes_rejects_ids_outside_the_vocabulary(tokenizer_for):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer_for("smollm2").token_bytes(49152)


# Tiny synthetic vocabularies: behaviour the two real models do not exercise.

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_metadata(pieces: dict[str, float], add_space_prefix: bool = True) -> dict:
    """A SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then `pieces` with their scores."""
    tokens = ["<unk>", "<s>", "</s>", *BYTE_TOKENS, *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *[0.0] * 256, *pieces.values()],
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * len(pieces)],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def pieces_of(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.token_bytes(i).decode() for i in ids]


@pytest.mark.parametrize(("ab", "bc", "expected"), [(-2.0, -1.0, ["a", "bc"]), (-1.0, -2.0, ["ab", "c"])])
def test_sentencepiece_merges_the_best_scoring_pair_first(ab, bc, expected):
    pieces = {"a": -10, "b": -11, "c": -12, "ab": ab, "bc": bc}
    tokenizer = Tokenizer.from_gguf(sentencepiece_metadata(pieces, add_space_prefix=False))
    assert pieces_of(tokenizer, tokenizer.encode("abc", add_special=False)) == expected


def test_sentencepiece_falls_back_to_bytes_for_unknown_characters():
    tokenizer = Tokenizer.from_gguf(sentencepiece_metadata({"a": -1}, add_space_prefix=False))
    ids = tokenizer.encode("aé", add_special=False)
    assert ids == [tokenizer.encode("a", add_special=False)[0], 3 + 0xC3, 3 + 0xA9]
    assert tokenizer.decode(ids) == "aé"


def test_sentencepiece_space_prefix_is_added_on_encode_and_dropped_on_decode():
    tokenizer = Tokenizer.from_gguf(sentencepiece_metadata({"▁": -1, "a": -2, "▁a": -3}))
    ids = tokenizer.encode("a a")
    assert ids[0] == 1 and pieces_of(tokenizer, ids[1:]) == [" a", " a"]
    assert tokenizer.decode(ids[1:]) == "a a"


def byte_level_metadata(pre: str, specials: tuple[str, ...] = ("<|end|>",)) -> dict:
    """The 256 GPT-2 byte characters as tokens, no merges, then `specials` as control tokens."""
    tokens = [*_byte_decoder(), *specials]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] * len(specials),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 256,
    }


def test_unknown_pre_tokenizer_is_a_typed_error_naming_it():
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        Tokenizer.from_gguf(byte_level_metadata("no-such-pre"))


def test_missing_pre_tokenizer_is_llama_cpp_default():
    metadata = byte_level_metadata("default")
    del metadata["tokenizer.ggml.pre"]
    tokenizer = Tokenizer.from_gguf(metadata)
    assert tokenizer.encode("<|end|>") == [256]
    assert tokenizer.decode(tokenizer.encode("héllo <|end|>")) == "héllo <|end|>"
    assert tokenizer.eog_ids == frozenset({256})


def test_unsupported_tokenizer_model_is_a_typed_error():
    with pytest.raises(TokenizerError, match="'rwkv'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


def test_harmony_markers_are_always_parsed_and_end_does_not_end_generation():
    # gpt-oss: llama.cpp renders and parses <|channel|> and <|end|> like user-defined tokens, and
    # generation goes on after <|end|> (it stops at <|return|> and <|call|>).
    specials = ("<|return|>", "<|channel|>", "<|end|>", "<|call|>")
    tokenizer = Tokenizer.from_gguf(byte_level_metadata("gpt-4o", specials))
    assert tokenizer.encode("<|channel|>x<|end|>", parse_special=False) == [257, _byte_id("x"), 258]
    assert len(tokenizer.encode("<|return|>", parse_special=False)) == len("<|return|>")
    assert tokenizer.eog_ids == frozenset({256, 259})
    assert tokenizer.decode([257, 256], skip_special=True) == "<|channel|>"


def _byte_id(char: str) -> int:
    return list(_byte_decoder()).index(char)


PRE_TOKENIZER_SAMPLE = "Hello, y'all! 3333333 ½ 日本語の文 ÄpFel  \n\n\t x\u00a0y  it's 😶\u200d🌫️ ..."


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_cuts_text_into_words_that_join_back(name):
    pre = PRE_TOKENIZERS[name]
    words = [w for w, _ in pre.backend().pre_tokenize_str(PRE_TOKENIZER_SAMPLE)]
    joined = "".join(words)
    if pre.byte_level:
        joined = bytes(map(_byte_decoder().__getitem__, joined)).decode()
    assert len(words) > 1 and joined == PRE_TOKENIZER_SAMPLE


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("tiny_aya", "1234567", ["1", "234", "567"]),  # llama.cpp's digit-group splitter
        # The splitter keeps a digit group with the text before it, so the space before NBSP is alone.
        ("tiny_aya", "a \u00a09", ["a", " ", "\u00a0", "9"]),
        ("superbpe", "1234567", ["1", "234", "567"]),
        ("falcon", "3333", ["333", "3"]),
        ("falcon", "\n =", ["\n ", "="]),  # the GPT-2 regex runs on what the punctuation regex left
        ("deepseek-llm", "ab \ncd  ", ["ab", " ", "\n", "cd", "  "]),  # "\s+$" is the end of a piece
        ("deepseek-coder", "4 ½", ["4", " ", "½"]),
        ("deepseek-coder", "中\u3000文", ["中", "\u3000", "文"]),  # a space outside ASCII is only \s
        ("deepseek-llm", "\t \u30009", ["\t \u3000", "9"]),
        ("kimi-k2", "ab中文cd", ["ab", "中文", "cd"]),
        ("qwen35", "y'all", ["y", "'all"]),
        ("gemma4", "a b\n\nc", ["a b", "\n\n", "c"]),
    ],
)
def test_pre_tokenizer_cuts_as_llama_cpp_does(name, text, words):
    pre = PRE_TOKENIZERS[name]
    got = [w for w, _ in pre.backend().pre_tokenize_str(text)]
    if pre.byte_level:
        got = [bytes(map(_byte_decoder().__getitem__, w)).decode() for w in got]
    assert got == words
