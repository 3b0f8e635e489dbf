"""GGUF tokenizer metadata -> text <-> token ids, as llama.cpp gives them.

Every tokenizer model llama.cpp's vocabulary suite uses is read, each in its own module:

* ``gpt2`` (bpe.py): byte-level BPE with the file's merges, split into words first by the regexes
  of its `tokenizer.ggml.pre` type (pretokenizers.py; an unknown type is refused);
* ``gemma4`` (bpe.py): SentencePiece-style BPE with merges, spaces as "▁", byte fallback;
* ``llama`` (spm.py): SentencePiece BPE from token scores, byte fallback;
* ``bert`` (wordpiece.py): WordPiece with BERT's normalizer;
* ``t5`` (unigram.py): Unigram with the file's precompiled SentencePiece normalizer.

Which tokens are cut out of the text before the model runs, and how each token decodes, follow
llama.cpp's token attributes (vocab.py). codec.py joins the pieces into `Tokenizer`.
"""

from corral.tokenizer.codec import MODELS, IncrementalDecoder, Tokenizer, adds_bos, load_tokenizer
from corral.tokenizer.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from corral.tokenizer.vocab import TokenAttr, TokenizerError, TokenType

__all__ = [
    "MODELS",
    "PRE_TOKENIZERS",
    "IncrementalDecoder",
    "PreTokenizer",
    "TokenAttr",
    "TokenType",
    "Tokenizer",
    "TokenizerError",
    "adds_bos",
    "load_tokenizer",
]
