"""Tiny random GGUF models for unit tests: one writer per architecture, each with a real tokenizer.

Every writer takes the file path, config overrides by short name (`block_count=3`,
`sliding_window=4096`) and three knobs for error tests:

* `architecture` renames the architecture (`general.architecture` and the `<arch>.*` key prefix);
* `drop` leaves out the named tensors (`"blk.0.attn_q.weight"`);
* `tensor_types` changes a tensor's GGML type; types `gguf.quants` cannot quantize are written as
  random codes with block scales that keep the array's spread (`random_quantized`), or, where
  gguf cannot read the type either, random bytes of the right size: enough for a loader that
  must refuse them.

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
        pass
    if dequantizable(qtype):  # IQ*, TQ*, NVFP4: random codes at the array's scale
        return random_quantized(qtype, array.shape, rng, std=float(array.std()))
    # Types gguf cannot read either: random bytes of the right size still make a valid file.
    byte_shape = gguf.quants.quant_shape_to_byte_shape(array.shape, qtype)
    return rng.integers(0, 256, byte_shape, dtype=np.uint8)


def dequantizable(qtype: Q) -> bool:
    """Whether `gguf.quants.dequantize` reads `qtype`."""
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# Byte offsets of each block's fp16 scales (d, and dmin or m where the format has one). IQ1_M
# spreads its fp16 scale over the top nibbles of bytes 49, 51, 53 and 55; MXFP4 keeps an E8M0
# exponent in byte 0, NVFP4 four UE4M3 scales in bytes 0-3.
FP16_SCALES = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.IQ1_S: [0],
    Q.IQ2_XXS: [0],
    Q.IQ2_XS: [0],
    Q.IQ2_S: [0],
    Q.IQ3_XXS: [0],
    Q.IQ3_S: [0],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.TQ1_0: [52],
    Q.TQ2_0: [64],
}
IQ1_M_SCALE_BYTES = [49, 51, 53, 55]


def finite_fp16(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` fp16 values drawn from every finite bit pattern alike (subnormals and 65504 included)."""
    patterns = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    return np.where(patterns & 0x7C00 == 0x7C00, patterns ^ 0x4000, patterns).astype(np.uint16).view(np.float16)


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator, scales: np.ndarray | None = None) -> np.ndarray:
    """Random bytes [n_blocks, type_size] of a quantized `qtype`: random codes, and every block
    scale set to `scales` [n_blocks] (rounded to the type's scale format), or, without them,
    drawn from every finite value (MXFP4's and NVFP4's scale bytes are finite as they come)."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)

    def fp16() -> np.ndarray:
        return finite_fp16(rng, n_blocks) if scales is None else np.asarray(scales).astype(np.float16)

    for offset in FP16_SCALES.get(qtype, []):
        blocks[:, offset : offset + 2] = fp16().view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:
        parts = (fp16().view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        blocks[:, IQ1_M_SCALE_BYTES] = (blocks[:, IQ1_M_SCALE_BYTES] & 0x0F) | (parts.astype(np.uint8) << 4)
    if qtype == Q.MXFP4 and scales is not None:  # the nearest power of two, 2^(e - 128) halved
        exponent = np.rint(np.log2(np.maximum(np.abs(scales), 2.0**-128))) + 128
        blocks[:, 0] = np.clip(exponent, 0, 255).astype(np.uint8)
    if qtype == Q.NVFP4 and scales is not None:  # the nearest UE4M3 code, for all four groups
        table = gguf.quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8))
        codes = np.abs(np.abs(np.asarray(scales))[:, None] - table[None, :]).argmin(-1)
        blocks[:, 0:4] = codes.astype(np.uint8)[:, None]
    return blocks


def random_quantized(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator, std: float = 0.05) -> np.ndarray:
    """The bytes of a `qtype` tensor of `shape` with random codes, whose values have about `std`
    (block scales vary by up to 1.5x either way)."""
    n_blocks = int(np.prod(shape)) // gguf.GGML_QUANT_SIZES[qtype][0]
    unit = random_blocks(qtype, n_blocks, rng, np.ones(n_blocks))
    spread = float(gguf.quants.dequantize(unit, qtype).std())
    blocks = random_blocks(qtype, n_blocks, rng, rng.uniform(2 / 3, 3 / 2, n_blocks) * std / spread)
    return blocks.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))


def write_dequantized_copy(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """The GGUF file at `path` rewritten with every tensor F32 as `gguf.quants.dequantize` reads
    it (metadata unchanged): the float32 reference of a quantized file."""
    reader = gguf.GGUFReader(os.fspath(path))
    writer = gguf.GGUFWriter(os.fspath(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(out)


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
