"""Tiny random GGUF models for unit tests: one writer per architecture, each with a real tokenizer.

Every writer takes the file path, config overrides by short name (`block_count=3`,
`sliding_window=4096`) and three knobs for error tests:

* `architecture` renames the architecture (`general.architecture` and the `<arch>.*` key prefix);
* `drop` leaves out the named tensors (`"blk.0.attn_q.weight"`);
* `tensor_types` changes a tensor's GGML type; types `gguf.quants` cannot quantize are written as
  random bytes of the right size, which is enough for a loader that must refuse them.

Weights are drawn from a generator seeded by `seed`, in a fixed order that does not depend on the
metadata, so two files that differ only in metadata hold the same weights. Most tensors are F32;
each model also has a Q4_0 and a Q8_0 linear so the quantized load paths run (in_features are
multiples of 32 for the int4 kernel, out_features multiples of 16).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Short override names -> GGUF key suffix after `<arch>.`.
_KEYS = {
    "block_count": "block_count",
    "embedding_length": "embedding_length",
    "feed_forward_length": "feed_forward_length",
    "context_length": "context_length",
    "head_count": "attention.head_count",
    "head_count_kv": "attention.head_count_kv",
    "key_length": "attention.key_length",
    "value_length": "attention.value_length",
    "sliding_window": "attention.sliding_window",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "norm_eps": "attention.layer_norm_epsilon",
    "rope_base": "rope.freq_base",
}

LLAMA = dict(
    block_count=2, embedding_length=64, feed_forward_length=128, context_length=128,
    head_count=4, head_count_kv=2, rms_eps=1e-5, rope_base=10000.0,
)
GEMMA3 = dict(
    # Six blocks: layers 0-4 slide, layer 5 is global. A window of 4 is crossed by a 10-token test.
    block_count=6, embedding_length=64, feed_forward_length=128, context_length=128,
    head_count=4, head_count_kv=2, key_length=16, value_length=16, sliding_window=4,
    rms_eps=1e-6, rope_base=1000000.0,
)
GPT2 = dict(
    block_count=2, embedding_length=64, feed_forward_length=256, context_length=64,
    head_count=4, norm_eps=1e-5,
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's 256 byte-level characters, in its vocabulary order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [chr(b) for b in printable], 0
    for b in range(256):
        if b not in printable:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
VOCAB = [*_bytes_to_unicode(), *(m.replace(" ", "") for m in MERGES), "<|endoftext|>"]
VOCAB_TYPES = [int(gguf.TokenType.NORMAL)] * (len(VOCAB) - 1) + [int(gguf.TokenType.CONTROL)]
VOCAB_SIZE = len(VOCAB)
EOT_ID = len(VOCAB) - 1


class _Tensors:
    """Draws the tensors of one model in order; `drop` and `tensor_types` apply at write time."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.arrays: dict[str, np.ndarray] = {}

    def weight(self, name: str, shape: tuple[int, ...], std: float = 0.05) -> None:
        self.arrays[name] = self.rng.normal(0.0, std, shape).astype(np.float32)

    def norm(self, name: str, dim: int) -> None:
        self.arrays[name] = (1.0 + self.rng.normal(0.0, 0.1, dim)).astype(np.float32)

    def bias(self, name: str, dim: int) -> None:
        self.arrays[name] = self.rng.normal(0.0, 0.02, dim).astype(np.float32)


def _config(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(_KEYS)
    if unknown:
        raise TypeError(f"unknown tiny-model settings {sorted(unknown)}; known: {sorted(_KEYS)}")
    return {**defaults, **overrides}


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types(VOCAB_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOT_ID)
    writer.add_eos_token_id(EOT_ID)
    writer.add_add_bos_token(False)


def _encode(array: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return array
    try:
        return gguf.quants.quantize(array, qtype)
    except NotImplementedError:
        # Types gguf cannot quantize (IQ*, TQ*): random bytes of the right size still make a valid file.
        byte_shape = gguf.quants.quant_shape_to_byte_shape(array.shape, qtype)
        return rng.integers(0, 256, byte_shape, dtype=np.uint8)


def _write(
    path: str | os.PathLike,
    architecture: str,
    config: dict[str, Any],
    tensors: _Tensors,
    types: dict[str, Q],
    drop: Iterable[str],
) -> str:
    writer = gguf.GGUFWriter(os.fspath(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)  # F32 but for a few quantized linears, like llama.cpp's mixes
    for name, value in config.items():
        _add_value(writer, f"{architecture}.{_KEYS[name]}", value)
    _add_tokenizer(writer)
    dropped = set(drop)
    missing = dropped - set(tensors.arrays)
    if missing:
        raise KeyError(f"cannot drop {sorted(missing)}: the model has no such tensors")
    kept = {name: (array, types.get(name, Q.F32)) for name, array in tensors.arrays.items() if name not in dropped}
    write_tensors(writer, kept, tensors.rng)
    return os.fspath(path)


def write_tensors(writer: gguf.GGUFWriter, tensors: dict[str, tuple[np.ndarray, Q]], rng: np.random.Generator) -> None:
    """Add each float32 array encoded as its GGML type, then write the file out and close it."""
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, _encode(array, qtype, rng), raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(
    path: str | os.PathLike,
    *,
    architecture: str = "llama",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 2-block llama (GQA 4/2 heads of 16, hidden 64, tied output) with Q4_0 and Q8_0 linears."""
    cfg = _config(LLAMA, overrides)
    d, ff, kv = cfg["embedding_length"], cfg["feed_forward_length"], cfg["head_count_kv"]
    head_dim = d // cfg["head_count"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        t.weight(p + "attn_q.weight", (d, d))
        t.weight(p + "attn_k.weight", (kv * head_dim, d))
        t.weight(p + "attn_v.weight", (kv * head_dim, d))
        t.weight(p + "attn_output.weight", (d, d))
        t.norm(p + "ffn_norm.weight", d)
        t.weight(p + "ffn_gate.weight", (ff, d))
        t.weight(p + "ffn_up.weight", (ff, d))
        t.weight(p + "ffn_down.weight", (d, ff))
    t.norm("output_norm.weight", d)
    types = {"blk.0.attn_q.weight": Q.Q4_0, "blk.0.ffn_down.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


def write_tiny_gemma3(
    path: str | os.PathLike,
    *,
    architecture: str = "gemma3",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 6-block gemma3 (5 sliding layers with window 4, then a global one) with Q4_0 and Q8_0 linears."""
    cfg = _config(GEMMA3, overrides)
    d, ff = cfg["embedding_length"], cfg["feed_forward_length"]
    heads, kv, dk, dv = cfg["head_count"], cfg["head_count_kv"], cfg["key_length"], cfg["value_length"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        t.weight(p + "attn_q.weight", (heads * dk, d))
        t.weight(p + "attn_k.weight", (kv * dk, d))
        t.weight(p + "attn_v.weight", (kv * dv, d))
        t.norm(p + "attn_q_norm.weight", dk)
        t.norm(p + "attn_k_norm.weight", dk)
        t.weight(p + "attn_output.weight", (d, heads * dv))
        t.norm(p + "post_attention_norm.weight", d)
        t.norm(p + "ffn_norm.weight", d)
        t.weight(p + "ffn_gate.weight", (ff, d))
        t.weight(p + "ffn_up.weight", (ff, d))
        t.weight(p + "ffn_down.weight", (d, ff))
        t.norm(p + "post_ffw_norm.weight", d)
    t.norm("output_norm.weight", d)
    types = {"blk.0.attn_q.weight": Q.Q4_0, "blk.5.ffn_down.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


def write_tiny_gpt2(
    path: str | os.PathLike,
    *,
    architecture: str = "gpt2",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 2-block GPT-2 (LayerNorms with bias, fused QKV, learned positions) with Q4_0 and Q8_0 linears."""
    cfg = _config(GPT2, overrides)
    d, ff = cfg["embedding_length"], cfg["feed_forward_length"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    t.weight("position_embd.weight", (cfg["context_length"], d), std=0.02)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        t.bias(p + "attn_norm.bias", d)
        t.weight(p + "attn_qkv.weight", (3 * d, d))
        t.bias(p + "attn_qkv.bias", 3 * d)
        t.weight(p + "attn_output.weight", (d, d))
        t.bias(p + "attn_output.bias", d)
        t.norm(p + "ffn_norm.weight", d)
        t.bias(p + "ffn_norm.bias", d)
        t.weight(p + "ffn_up.weight", (ff, d))
        t.bias(p + "ffn_up.bias", ff)
        t.weight(p + "ffn_down.weight", (d, ff))
        t.bias(p + "ffn_down.bias", d)
    t.norm("output_norm.weight", d)
    t.bias("output_norm.bias", d)
    types = {"blk.0.attn_qkv.weight": Q.Q4_0, "blk.1.ffn_down.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


WRITERS = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3, "gpt2": write_tiny_gpt2}
