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
    "rope_dims": "rope.dimension_count",
    "rope_scaling_type": "rope.scaling.type",
    "rope_scaling_factor": "rope.scaling.factor",
    "rope_original_context": "rope.scaling.original_context_length",
    "rope_yarn_log_mul": "rope.scaling.yarn_log_multiplier",
    "expert_count": "expert_count",
    "expert_used_count": "expert_used_count",
    "expert_feed_forward_length": "expert_feed_forward_length",
    "expert_shared_count": "expert_shared_count",
    "expert_weights_norm": "expert_weights_norm",
    "expert_weights_scale": "expert_weights_scale",
    "expert_gating_func": "expert_gating_func",
    "expert_group_count": "expert_group_count",
    "expert_group_used_count": "expert_group_used_count",
    "leading_dense_block_count": "leading_dense_block_count",
    "q_lora_rank": "attention.q_lora_rank",
    "kv_lora_rank": "attention.kv_lora_rank",
    "key_length_mla": "attention.key_length_mla",
    "value_length_mla": "attention.value_length_mla",
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
MIXTRAL = dict(LLAMA, expert_count=4, expert_used_count=2)
QWEN3MOE = dict(
    block_count=2, embedding_length=64, context_length=128, head_count=4, head_count_kv=2,
    key_length=32, value_length=32, rms_eps=1e-6, rope_base=1000000.0,
    expert_count=8, expert_used_count=2, expert_feed_forward_length=32,
)
GPT_OSS = dict(
    # Layer 0 slides (window 4), layer 1 is global; YaRN over an original context of 32.
    block_count=2, embedding_length=64, context_length=256, head_count=4, head_count_kv=2,
    key_length=16, value_length=16, sliding_window=4, rms_eps=1e-5, rope_base=150000.0,
    rope_scaling_type="yarn", rope_scaling_factor=8.0, rope_original_context=32,
    expert_count=4, expert_used_count=2, expert_feed_forward_length=32,
)
DEEPSEEK2 = dict(
    # MLA as the converter writes it (key/value lengths of the latent, the heads' in the _mla keys);
    # block 0 dense, then sigmoid routing over 2 groups of 4 experts with a shared expert; YaRN.
    block_count=3, embedding_length=64, feed_forward_length=96, context_length=256, head_count=4, head_count_kv=1,
    q_lora_rank=32, kv_lora_rank=32, key_length=48, value_length=32, key_length_mla=32, value_length_mla=16,
    rope_dims=16, rms_eps=1e-6, rope_base=10000.0, rope_scaling_type="yarn", rope_scaling_factor=4.0,
    rope_original_context=32, rope_yarn_log_mul=0.1, leading_dense_block_count=1,
    expert_count=8, expert_used_count=2, expert_feed_forward_length=32, expert_shared_count=1,
    expert_gating_func=2, expert_group_count=2, expert_group_used_count=1, expert_weights_norm=True,
    expert_weights_scale=2.5,
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


def _llama_attention(t: _Tensors, p: str, d: int, kv_width: int) -> None:
    """A llama block's attention tensors and its ffn_norm, in the draw order both llama writers share."""
    t.norm(p + "attn_norm.weight", d)
    t.weight(p + "attn_q.weight", (d, d))
    t.weight(p + "attn_k.weight", (kv_width, d))
    t.weight(p + "attn_v.weight", (kv_width, d))
    t.weight(p + "attn_output.weight", (d, d))
    t.norm(p + "ffn_norm.weight", d)


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
        _llama_attention(t, p, d, kv * head_dim)
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


def _experts(t: _Tensors, p: str, cfg: dict[str, Any], ff: int, biases: bool = False) -> None:
    """A router and SwiGLU expert stacks [experts, out, in] under `p`."""
    d, n = cfg["embedding_length"], cfg["expert_count"]
    t.weight(p + "ffn_gate_inp.weight", (n, d), std=0.3)
    t.weight(p + "ffn_gate_exps.weight", (n, ff, d))
    t.weight(p + "ffn_up_exps.weight", (n, ff, d))
    t.weight(p + "ffn_down_exps.weight", (n, d, ff))
    if biases:
        t.bias(p + "ffn_gate_inp.bias", n)
        t.arrays[p + "ffn_gate_exps.bias"] = t.rng.normal(0.0, 0.02, (n, ff)).astype(np.float32)
        t.arrays[p + "ffn_up_exps.bias"] = t.rng.normal(0.0, 0.02, (n, ff)).astype(np.float32)
        t.arrays[p + "ffn_down_exps.bias"] = t.rng.normal(0.0, 0.02, (n, d)).astype(np.float32)


def write_tiny_mixtral(
    path: str | os.PathLike,
    *,
    architecture: str = "llama",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 2-block Mixtral (a llama file with 4 SwiGLU experts a block, 2 chosen) with Q4_0 and Q8_0 expert stacks."""
    cfg = _config(MIXTRAL, overrides)
    d, ff, kv = cfg["embedding_length"], cfg["feed_forward_length"], cfg["head_count_kv"]
    head_dim = d // cfg["head_count"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        _llama_attention(t, p, d, kv * head_dim)
        _experts(t, p, cfg, ff)
    t.norm("output_norm.weight", d)
    types = {"blk.0.ffn_up_exps.weight": Q.Q4_0, "blk.1.ffn_down_exps.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


def write_tiny_qwen3moe(
    path: str | os.PathLike,
    *,
    architecture: str = "qwen3moe",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 2-block Qwen 3 MoE (heads of 32 over hidden 64, q/k norms, 8 experts, 2 chosen) with Q4_0 and Q8_0 linears."""
    cfg = _config(QWEN3MOE, overrides)
    d, heads, kv, dk = cfg["embedding_length"], cfg["head_count"], cfg["head_count_kv"], cfg["key_length"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        t.weight(p + "attn_q.weight", (heads * dk, d))
        t.weight(p + "attn_k.weight", (kv * dk, d))
        t.weight(p + "attn_v.weight", (kv * dk, d))
        t.norm(p + "attn_q_norm.weight", dk)
        t.norm(p + "attn_k_norm.weight", dk)
        t.weight(p + "attn_output.weight", (d, heads * dk))
        t.norm(p + "ffn_norm.weight", d)
        _experts(t, p, cfg, cfg["expert_feed_forward_length"])
    t.norm("output_norm.weight", d)
    t.weight("output.weight", (VOCAB_SIZE, d))
    types = {"blk.0.attn_q.weight": Q.Q4_0, "blk.1.ffn_down_exps.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


def write_tiny_gpt_oss(
    path: str | os.PathLike,
    *,
    architecture: str = "gpt-oss",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A 2-block gpt-oss (sliding layer 0, sinks, biases everywhere, YaRN, 4 biased experts) with Q4_0 and Q8_0 linears."""
    cfg = _config(GPT_OSS, overrides)
    d, heads, kv, dk = cfg["embedding_length"], cfg["head_count"], cfg["head_count_kv"], cfg["key_length"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        for name, rows in (("attn_q", heads * dk), ("attn_k", kv * dk), ("attn_v", kv * dk)):
            t.weight(p + name + ".weight", (rows, d))
            t.bias(p + name + ".bias", rows)
        t.weight(p + "attn_output.weight", (d, heads * dk))
        t.bias(p + "attn_output.bias", d)
        t.arrays[p + "attn_sinks.weight"] = t.rng.normal(0.0, 1.0, heads).astype(np.float32)
        t.norm(p + "post_attention_norm.weight", d)
        _experts(t, p, cfg, cfg["expert_feed_forward_length"], biases=True)
    t.norm("output_norm.weight", d)
    t.weight("output.weight", (VOCAB_SIZE, d))
    types = {"blk.0.attn_q.weight": Q.Q4_0, "blk.0.ffn_down_exps.weight": Q.Q8_0, **(tensor_types or {})}
    return _write(path, architecture, cfg, t, types, drop)


def write_tiny_deepseek2(
    path: str | os.PathLike,
    *,
    architecture: str = "deepseek2",
    drop: Iterable[str] = (),
    tensor_types: dict[str, Q] | None = None,
    seed: int = 0,
    fused_kv_b: bool = False,
    **overrides: Any,
) -> str:
    """A 3-block DeepSeek V3 (MLA with low-rank q and split k_b/v_b, a dense block, then grouped sigmoid
    routing with selection bias and a shared expert, YaRN) with Q4_0 and Q8_0 linears.

    `fused_kv_b`: the same weights as older converters wrote them, k_b and v_b in one `attn_kv_b`
    with per-head key and value lengths."""
    cfg = _config(DEEPSEEK2, overrides)
    d, heads, rank, rot = cfg["embedding_length"], cfg["head_count"], cfg["kv_lora_rank"], cfg["rope_dims"]
    nope, dv, q_rank, ff = cfg["key_length_mla"] - rot, cfg["value_length_mla"], cfg["q_lora_rank"], cfg["expert_feed_forward_length"]
    t = _Tensors(seed)
    t.weight("token_embd.weight", (VOCAB_SIZE, d), std=0.1)
    for i in range(cfg["block_count"]):
        p = f"blk.{i}."
        t.norm(p + "attn_norm.weight", d)
        t.weight(p + "attn_q_a.weight", (q_rank, d))
        t.norm(p + "attn_q_a_norm.weight", q_rank)
        t.weight(p + "attn_q_b.weight", (heads * (nope + rot), q_rank), std=0.15)
        t.weight(p + "attn_kv_a_mqa.weight", (rank + rot, d), std=0.15)
        t.norm(p + "attn_kv_a_norm.weight", rank)
        t.weight(p + "attn_k_b.weight", (heads, rank, nope), std=0.15)
        t.weight(p + "attn_v_b.weight", (heads, dv, rank), std=0.15)
        t.weight(p + "attn_output.weight", (d, heads * dv))
        t.norm(p + "ffn_norm.weight", d)
        if i < cfg["leading_dense_block_count"]:
            t.weight(p + "ffn_gate.weight", (cfg["feed_forward_length"], d))
            t.weight(p + "ffn_up.weight", (cfg["feed_forward_length"], d))
            t.weight(p + "ffn_down.weight", (d, cfg["feed_forward_length"]))
            continue
        _experts(t, p, cfg, ff)
        t.arrays[p + "exp_probs_b.bias"] = t.rng.normal(0.0, 0.05, cfg["expert_count"]).astype(np.float32)
        shared = ff * cfg["expert_shared_count"]
        t.weight(p + "ffn_gate_shexp.weight", (shared, d))
        t.weight(p + "ffn_up_shexp.weight", (shared, d))
        t.weight(p + "ffn_down_shexp.weight", (d, shared))
    t.norm("output_norm.weight", d)
    t.weight("output.weight", (VOCAB_SIZE, d))
    types = {"blk.1.attn_q_b.weight": Q.Q4_0, "blk.2.ffn_down_exps.weight": Q.Q8_0, **(tensor_types or {})}
    if fused_kv_b:
        for i in range(cfg["block_count"]):
            k_b, v_b = t.arrays.pop(f"blk.{i}.attn_k_b.weight"), t.arrays.pop(f"blk.{i}.attn_v_b.weight")
            t.arrays[f"blk.{i}.attn_kv_b.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)
        cfg.update(head_count_kv=heads, key_length=cfg.pop("key_length_mla"), value_length=cfg.pop("value_length_mla"))
    else:
        types.setdefault("blk.0.attn_v_b.weight", Q.Q8_0)
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


WRITERS = {
    "llama": write_tiny_llama,
    "gemma3": write_tiny_gemma3,
    "gpt2": write_tiny_gpt2,
    "mixtral": write_tiny_mixtral,
    "qwen3moe": write_tiny_qwen3moe,
    "gpt-oss": write_tiny_gpt_oss,
    "deepseek2": write_tiny_deepseek2,
}


GEMMA3_PROJECTOR = dict(image_size=16, patch_size=4, embedding_length=32, feed_forward_length=64, block_count=1, head_count=2, merge=2)


def write_tiny_gemma3_projector(
    path: str | os.PathLike, *, projection_dim: int = GEMMA3["embedding_length"], matrix_type: Q = Q.F32, seed: int = 0,
    projector_type: str = "gemma3",
) -> str:
    """A Gemma 3 vision projector (llama.cpp's `clip` file, projector type "gemma3"): a 1-block SigLIP over
    4 x 4 patches of a 16-pixel image, pooled 2 x 2 into 4 embeddings `projection_dim` wide (write_tiny_gemma3's).
    `matrix_type` is the type of the blocks' matrices (F16, Q8_0, ...), as a converter's or quantizer's output has them;
    `projector_type` renames the projector (to one no encoder reads, for error tests)."""
    cfg = GEMMA3_PROJECTOR
    d, ff, patch = cfg["embedding_length"], cfg["feed_forward_length"], cfg["patch_size"]
    t = _Tensors(seed)
    t.weight("mm.input_projection.weight", (d, projection_dim), std=0.1)  # used as x @ W: [vision, text]
    t.norm("mm.soft_emb_norm.weight", d)
    t.weight("v.patch_embd.weight", (d, 3, patch, patch), std=0.1)
    t.bias("v.patch_embd.bias", d)
    t.weight("v.position_embd.weight", ((cfg["image_size"] // patch) ** 2, d), std=0.1)
    matrices = []
    for i in range(cfg["block_count"]):
        p = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            t.norm(p + norm + ".weight", d)
            t.bias(p + norm + ".bias", d)
        for name, shape in (("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_out", (d, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
            t.weight(p + name + ".weight", shape, std=0.1)
            t.bias(p + name + ".bias", shape[0])
            matrices.append(p + name + ".weight")
    t.norm("v.post_ln.weight", d)
    t.bias("v.post_ln.bias", d)
    writer = gguf.GGUFWriter(os.fspath(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_string("clip.projector_type", projector_type)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    for key, value in (("image_size", cfg["image_size"]), ("patch_size", patch), ("embedding_length", d), ("feed_forward_length", ff),
                       ("block_count", cfg["block_count"]), ("attention.head_count", cfg["head_count"]), ("projection_dim", projection_dim),
                       ("projector.scale_factor", cfg["merge"])):  # fmt: skip
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    types = dict.fromkeys(matrices, matrix_type)
    write_tensors(writer, {name: (array, types.get(name, Q.F32)) for name, array in t.arrays.items()}, t.rng)
    return os.fspath(path)
