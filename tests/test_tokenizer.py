"""Tokenizers built from GGUF metadata give llama.cpp's ids and decode back to the text."""

from __future__ import annotations

import pytest
from conftest import reference_tokens

from corral.gguf import GGUFFile
from corral.plugins.architectures.gemma3 import Gemma3Model
from corral.template import ChatTemplate
from corral.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError

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


def byte_level_metadata(pre: str) -> dict:
    from corral.tokenizer.codec import _byte_decoder

    tokens = [*_byte_decoder(), "<|end|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3],
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
