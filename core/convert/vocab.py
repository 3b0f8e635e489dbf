"""The tokenizer keys of a converted GGUF, read from the folder's tokenizer.json with `tokenizers`.

Two vocabularies are written the way llama.cpp's converter writes them: byte-level BPE ("gpt2": the
token list with each token's type, merges) and WordPiece ("bert": continuation pieces lose their
"##", word-initial ones gain SentencePiece's "▁"). Special token ids, add_bos/add_eos and the chat
template come from gguf.SpecialVocab, which reads tokenizer_config.json, config.json and
generation_config.json as llama.cpp does.
"""

from __future__ import annotations

import json
import logging

import gguf
from tokenizers import Tokenizer

from corral.convert.folder import ConvertError, HFFolder

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
SPM_SPACE = "\u2581"


def load_tokenizer(folder: HFFolder) -> Tokenizer:
    if not folder.has(TOKENIZER_JSON):
        raise ConvertError(f"{folder.path} has no {TOKENIZER_JSON}: the converter reads this model's tokenizer from it")
    try:
        tokenizer = Tokenizer.from_file(str(folder.path / TOKENIZER_JSON))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConvertError(f"cannot read {TOKENIZER_JSON} in {folder.path}: {error}") from None
    # A file may fix a padded length for its own use (all-MiniLM pads to 128): encode one text as it is.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def looks_special(token: str) -> bool:
    """Added tokens some models leave unmarked though they are control tokens (llama.cpp's heuristics)."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def token_list(folder: HFFolder, tokenizer: Tokenizer) -> tuple[list[str], list[int]]:
    """Every id below the config's vocab_size: its text and gguf.TokenType; ids with no token are UNUSED pads."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = folder.config.get("vocab_size") or len(vocab)
    if max(vocab.values()) >= size:
        raise ConvertError(f"{TOKENIZER_JSON} has ids up to {max(vocab.values())}, more than config.json's vocab_size {size}")
    by_id = {i: text for text, i in vocab.items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            token = added[i]
            if not token.normalized:  # llama.cpp takes added tokens as already normalized: normalize it
                text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            if token.special or looks_special(text):
                types.append(gguf.TokenType.CONTROL)
            else:
                text = text.replace(SPM_SPACE, " ")
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def pre_tokenizer_name(folder: HFFolder) -> str:
    """llama.cpp's name for the folder's pre-tokenizer (`tokenizer.ggml.pre`), recognised by its structure.

    llama.cpp's converter recognises a pre-tokenizer by hashing a published tokenizer's output on a
    test text; corral looks at what tokenizer.json says instead, which also covers a fine-tune's or a
    test's tokenizer. Unrecognised ones get "default" (llama.cpp then splits as GPT-2 does), with a warning.
    """
    spec = folder.json(TOKENIZER_JSON)
    model = (spec.get("model") or {}).get("type")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    patterns = [json.dumps(step.get("pattern", "")) for step in steps if step.get("type") == "Split"]
    if model == "WordPiece" and kinds == ["BertPreTokenizer"]:
        return "jina-v2-en"  # what llama.cpp's hash table says for BERT's lower-casing WordPiece (all-MiniLM, bge)
    if kinds == ["ByteLevel"] and pre.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"  # SmolLM's (and StarCoder's) GPT-2 split with one digit per token
    if kinds == ["Split", "ByteLevel"] and "\\\\p{N}{1,3}" in patterns[0]:
        return "llama-bpe"  # Llama 3's split: up to three digits per token
    if kinds == ["Split", "ByteLevel"] and "\\\\p{N}|" in patterns[0]:
        return "qwen2"
    log.warning("%s: unrecognised pre-tokenizer %s; writing tokenizer.ggml.pre 'default'", folder.path, kinds)
    return "default"


def add_json_vocab(writer: gguf.GGUFWriter, folder: HFFolder) -> None:
    """Write the tokenizer keys of a byte-level BPE or WordPiece tokenizer.json."""
    tokenizer = load_tokenizer(folder)
    kind = (folder.json(TOKENIZER_JSON).get("model") or {}).get("type")
    tokens, types = token_list(folder, tokenizer)
    if kind == "WordPiece":
        writer.add_token_type_count(folder.config.get("type_vocab_size", 1))
        tokens = [_phantom_space(token, kind) for token, kind in zip(tokens, types)]
        writer.add_tokenizer_model("bert")
    elif kind == "BPE":
        writer.add_tokenizer_model(gguf.BpeVocab.tokenizer_model)
    else:
        raise ConvertError(f"{TOKENIZER_JSON} in {folder.path} is a {kind} tokenizer; corral converts BPE and WordPiece ones")
    writer.add_tokenizer_pre(pre_tokenizer_name(folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder.path, load_merges=kind == "BPE", n_vocab=None if kind == "BPE" else len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if not hasattr(special, "normalizer_lowercase"):  # gguf releases before the normalizer flags
        add_normalizer_flags(writer, folder.json(TOKENIZER_JSON).get("normalizer") or {})


NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"


def normalizer_flags(normalizer: dict) -> dict[str, bool]:
    """Whether tokenizer.json's normalizer lower-cases and strips accents (keys absent where it does not say)."""
    kind = normalizer.get("type")
    if kind == "Lowercase":
        return {NORMALIZER_LOWERCASE: True}
    if kind == "StripAccents":
        return {NORMALIZER_STRIP_ACCENTS: True}
    if kind == "BertNormalizer":
        said = {NORMALIZER_LOWERCASE: normalizer.get("lowercase"), NORMALIZER_STRIP_ACCENTS: normalizer.get("strip_accents")}
        return {key: value for key, value in said.items() if value is not None}
    flags: dict[str, bool] = {}
    for step in normalizer.get("normalizers", []) if kind == "Sequence" else []:
        flags |= normalizer_flags(step)
    return flags


def add_normalizer_flags(writer: gguf.GGUFWriter, normalizer: dict) -> None:
    """The normalizer keys llama.cpp's WordPiece tokenizer reads (newer gguf-py's SpecialVocab writes them itself)."""
    for key, value in normalizer_flags(normalizer).items():
        writer.add_bool(key, bool(value))


def _phantom_space(token: str, kind: int) -> str:
    """WordPiece as llama.cpp stores it: "##" continuations bare, word starts after "▁", control tokens as they are."""
    if kind == gguf.TokenType.CONTROL:
        return token
    return token[2:] if token.startswith("##") else SPM_SPACE + token


TOKENIZER_MODEL = "tokenizer.model"


def add_spm_vocab(writer: gguf.GGUFWriter, folder: HFFolder) -> None:
    """Write the tokenizer keys of a sentencepiece tokenizer.model ("llama": pieces, scores, types).

    As llama.cpp's converter: ids up to the config's vocab_size, unused ones "[PAD<id>]"; added_tokens.json
    and tokenizer_config.json's added_tokens_decoder override pieces (control or user-defined, score -1000).
    """
    write_spm_tokens(writer, folder, *spm_token_list(folder))


def write_spm_tokens(writer: gguf.GGUFWriter, folder: HFFolder, tokens: list[bytes], scores: list[float], types: list[int]) -> None:
    writer.add_tokenizer_model(gguf.SentencePieceVocab.tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder.path, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def spm_token_list(folder: HFFolder) -> tuple[list[bytes], list[float], list[int]]:
    """tokenizer.model's pieces, then tokenizer_config.json's added tokens (control when special or looking so)."""
    tokens, scores, types = spm_pieces(folder)
    decoder = (folder.json("tokenizer_config.json") or {}).get("added_tokens_decoder", {})
    for key, added in decoder.items():
        i, text = int(key), added["content"]
        if i >= len(tokens):
            continue
        if added.get("special") or looks_special(text):
            types[i] = gguf.TokenType.CONTROL
        else:
            text = text.replace(SPM_SPACE, " ")
            types[i] = gguf.TokenType.USER_DEFINED
        tokens[i], scores[i] = text.encode(), -1000.0
    return tokens, scores, types


def spm_pieces(folder: HFFolder) -> tuple[list[bytes], list[float], list[int]]:
    """tokenizer.model's pieces for every id below the config's vocab_size, with added_tokens.json over them."""
    from sentencepiece import SentencePieceProcessor

    processor = SentencePieceProcessor()
    try:
        processor.LoadFromFile(str(folder.path / TOKENIZER_MODEL))
    except (OSError, RuntimeError) as error:
        raise ConvertError(f"cannot read {TOKENIZER_MODEL} in {folder.path}: {error}") from None
    pieces = processor.vocab_size()
    size = folder.config.get("vocab_size") or pieces
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [gguf.TokenType.UNUSED] * size
    for i in range(min(pieces, size)):
        tokens[i] = processor.IdToPiece(i).encode()
        scores[i] = processor.GetScore(i)
        types[i] = _spm_type(processor, i)
    for text, i in (folder.json("added_tokens.json") or {}).items():
        if i < size:
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, gguf.TokenType.USER_DEFINED
    return tokens, scores, types


def _spm_type(processor, i: int) -> int:
    if processor.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if processor.IsControl(i):
        return gguf.TokenType.CONTROL
    if processor.IsUnused(i):
        return gguf.TokenType.UNUSED
    if processor.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL
