"""llama.cpp's tokenizer suite: every `models/ggml-vocab-*.gguf` loads, and every case of its
`.inp` file encodes to the ids of its `.out` file.

The conventions are those of llama.cpp's `tests/test-tokenizer-0.cpp`: cases are split on
``\\n__ggml_vocab_test__\\n`` (a separator at the very end opens no further case), each `.out` line is
one case's ids, no BOS/EOS is added and special tokens are not parsed from the text.
"""

from __future__ import annotations

import pathlib

import pytest

import corral
from corral.tokenizer import Tokenizer

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

SEPARATOR = "\n__ggml_vocab_test__\n"

# The vocabularies that come with .inp/.out cases, and those that only have to load and tokenize.
VOCABS_WITH_CASES = (
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
VOCABS_WITHOUT_CASES = ("aquila", "baichuan", "gpt-neox", "nomic-bert-moe")

# Tokenizers that normalize text (lowercasing, accents, whitespace) cannot give every text back.
LOSSY_VOCABS = frozenset({"bert-bge", "nomic-bert-moe"})

SAMPLE_TEXT = " Hello, world! 3.14 naïve café 日本語 🦙\n\n\tdone  "


def vocab_path(llama_cpp_dir: pathlib.Path, name: str) -> pathlib.Path:
    return llama_cpp_dir / "models" / f"ggml-vocab-{name}.gguf"


def read_cases(path: pathlib.Path) -> dict[str, list[int]]:
    """The text -> ids cases of one vocabulary, read as test-tokenizer-0.cpp reads them."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode()
    texts, pos = [], 0
    while pos < len(raw):
        end = raw.find(SEPARATOR, pos)
        if end < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:end])
        pos = end + len(SEPARATOR)
    lines = path.with_name(path.name + ".out").read_text().splitlines()
    assert len(texts) == len(lines), f"{path.name}: .inp has {len(texts)} cases, .out {len(lines)}"
    # A map, as in the C++ test: a repeated text is one case.
    return {text: [int(t) for t in line.split()] for text, line in zip(texts, lines)}


@pytest.fixture(scope="module")
def tokenizer_of(llama_cpp_dir):
    """Each vocabulary's tokenizer, built once per module."""
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = corral.load_tokenizer(vocab_path(llama_cpp_dir, name))
        return cache[name]

    return get


def first_mismatches(mismatches: list[str], total: int) -> str:
    shown = "\n".join(mismatches[:5])
    return f"{len(mismatches)} of {total} cases differ; the first few:\n{shown}"


@pytest.mark.parametrize("name", VOCABS_WITH_CASES)
def test_every_case_encodes_to_llama_cpp_ids(tokenizer_of, llama_cpp_dir, name):
    tokenizer = tokenizer_of(name)
    cases = read_cases(vocab_path(llama_cpp_dir, name))
    mismatches = []
    for text, expected in cases.items():
        ids = tokenizer.encode(text, add_special=False, parse_special=False)
        if ids != expected:
            mismatches.append(f"{text!r}:\n  expected {expected}\n  got      {ids}")
    assert not mismatches, first_mismatches(mismatches, len(cases))


@pytest.mark.parametrize("name", sorted(set(VOCABS_WITH_CASES) - LOSSY_VOCABS))
def test_every_case_decodes_back_to_its_text(tokenizer_of, llama_cpp_dir, name):
    tokenizer = tokenizer_of(name)
    cases = read_cases(vocab_path(llama_cpp_dir, name))
    mismatches = [f"{text!r} decoded as {tokenizer.decode(ids)!r}" for text, ids in cases.items() if tokenizer.decode(ids) != text]
    assert not mismatches, first_mismatches(mismatches, len(cases))


@pytest.mark.parametrize("name", VOCABS_WITHOUT_CASES)
def test_vocab_without_cases_loads_and_tokenizes(tokenizer_of, name):
    tokenizer = tokenizer_of(name)
    ids = tokenizer.encode(SAMPLE_TEXT, add_special=False, parse_special=False)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    if name not in LOSSY_VOCABS:
        assert tokenizer.decode(ids) == SAMPLE_TEXT


# Token attributes llama.cpp sets by model (the suite's texts never contain special tokens).


def test_phi3_special_tokens_swallow_the_whitespace_after_them(tokenizer_of):
    tokenizer = tokenizer_of("phi-3")
    assert tokenizer.encode("<|user|>\n Hello") == tokenizer.encode("<|user|>Hello") == [1, 32010, 15043]


def test_xlm_roberta_mask_swallows_the_whitespace_before_it(tokenizer_of):
    tokenizer = tokenizer_of("nomic-bert-moe")
    assert tokenizer.encode("a <mask>") == tokenizer.encode("a<mask>") == [0, 10, 250001, 2]


def test_wordpiece_frames_text_in_cls_and_sep(tokenizer_of):
    assert tokenizer_of("bert-bge").encode("hello") == [101, 7592, 102]


@pytest.mark.parametrize(
    ("name", "text"),
    [("bert-bge", " hello world"), ("bert-bge", " naive cafe"), ("nomic-bert-moe", "Hello world"), ("nomic-bert-moe", "naïve café 日本語")],
)
def test_normalizing_vocab_decodes_text_in_its_normal_form_back(tokenizer_of, name, text):
    tokenizer = tokenizer_of(name)
    assert tokenizer.decode(tokenizer.encode(text, add_special=False)) == text


@pytest.mark.parametrize(("text", "decoded"), [("!!!!!!", "!!!!!!"), ("Hello, y'all! It's", " hello, y'all! it's")])
def test_wordpiece_decode_drops_the_spaces_before_punctuation_as_llama_cpp_does(tokenizer_of, text, decoded):
    tokenizer = tokenizer_of("bert-bge")
    assert tokenizer.decode(tokenizer.encode(text, add_special=False)) == decoded


def test_wordpiece_strips_accents_as_llama_cpp_does(tokenizer_of):
    # Every mark goes (Devanagari's spacing vowel signs too), and a Hangul syllable keeps its
    # leading consonant only: llama.cpp's ids, which differ from Hugging Face's here.
    tokenizer = tokenizer_of("bert-bge")
    assert tokenizer.encode("नमस्ते", add_special=False) == [1327, 29867, 29874, 29859]
    assert tokenizer.encode("한국어", add_special=False) == [1469, 29991, 29999]
