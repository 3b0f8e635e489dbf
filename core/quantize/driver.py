"""Rewrite a GGUF file with its weights quantized to a preset, as llama-quantize does.

The metadata is copied key by key with its GGUF types (llama.cpp reads most keys with a fixed type),
`general.file_type` and `general.quantization_version` set as llama-quantize sets them; each tensor
gets the type `mix.tensor_types` chooses. A tensor already of that type is copied; one to convert is
read as float32 (F16 and BF16 exactly, a quantized one through gguf's dequantization: requantizing,
which llama-quantize refuses unless asked) and quantized: the 32-element types by gguf-py's
`gguf.quants`, the K-quants by `kquants`. Tensors are written one at a time through
`gguf.GGUFWriter`, so memory holds one tensor, not the model.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import attrs
import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, LlamaFileType
from gguf import GGMLQuantizationType as Q

from corral.errors import CorralError
from corral.ggml_types import GGMLQuantizationType
from corral.gguf import GGUFFile
from corral.quantize import kquants
from corral.quantize.mix import ModelShape, TensorShape, tensor_types
from corral.quantize.presets import Preset

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, which llama-quantize writes
UNQUANTIZED = frozenset({Q.F32, Q.F16, Q.BF16})
_K_TYPES = {Q.Q4_K: "Q4_K", Q.Q5_K: "Q5_K", Q.Q6_K: "Q6_K"}
_GGUF_PY_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})

Progress = Callable[[dict], None]


class QuantizeError(CorralError):
    """A GGUF cannot be quantized as asked (quantized already, a type corral cannot convert)."""


@attrs.frozen
class Plan:
    """What quantizing a file will do: each tensor's new type, and the name of the file's current type."""

    types: dict[str, Q]
    source_type: str


def source_type_name(source: GGUFFile) -> str:
    """The file's type as Ollama names it in progress (F16, Q8_0, Q4_K_M, ...): the most common type of
    its matrices when they are all unquantized, else `general.file_type`."""
    kinds = [info.qtype for info in source.tensors.values() if len(info.shape) >= 2]
    common = max(set(kinds), key=kinds.count).name if kinds else "F32"
    if set(kinds) <= UNQUANTIZED:
        return common
    try:
        return LlamaFileType(int(source.get("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return common


def is_quantized(qtype: Q) -> bool:
    return GGML_QUANT_SIZES[qtype][0] > 1


def model_shape(source: GGUFFile) -> ModelShape:
    arch = source.architecture

    def number(key: str) -> int:
        value = source.get(f"{arch}.{key}", 0)
        return int(max(value)) if isinstance(value, (list, np.ndarray)) else int(value)  # per-layer arrays

    return ModelShape(arch, number("block_count"), number("attention.head_count"), number("attention.head_count_kv"), number("expert_count"))


def plan(source: GGUFFile, preset: Preset, allow_requantize: bool = False) -> Plan:
    """Each tensor's type under `preset`; QuantizeError when a quantized tensor would need converting."""
    tensors = [TensorShape(info.name, info.shape, info.qtype) for info in source.tensors.values()]
    # GGUFFile's types are corral.ggml_types' (equal to gguf's by value); a type neither knows stays an int
    unknown = sorted(t.name for t in tensors if not isinstance(t.qtype, GGMLQuantizationType))
    if unknown:
        raise QuantizeError(f"cannot quantize: tensor {unknown[0]} has a GGML type gguf does not know")
    types = tensor_types(model_shape(source), tensors, preset)
    for tensor in tensors:
        new = types[tensor.name]
        if new == tensor.qtype:
            continue
        if is_quantized(tensor.qtype) and not allow_requantize:
            raise QuantizeError(
                f"requantizing from type {tensor.qtype.name} is disabled (tensor {tensor.name}): "
                "quantize an F32, F16 or BF16 model instead"
            )
        if tensor.qtype not in UNQUANTIZED and not _can_dequantize(tensor.qtype):
            raise QuantizeError(f"cannot convert tensor {tensor.name} from {tensor.qtype.name}")
    return Plan(types, source_type_name(source))


def _can_dequantize(qtype: Q) -> bool:
    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def quantize_file(
    source_path: str | os.PathLike,
    target_path: str | os.PathLike,
    preset: Preset,
    *,
    allow_requantize: bool = False,
    progress: Progress | None = None,
) -> Plan:
    """Write `source_path` quantized to `preset` into `target_path`; returns the plan it followed.

    Progress events are Ollama's: `{"status": "quantizing F16 model to Q4_K_M", "total", "completed"}`
    in bytes of the source tensors. A failure removes the target file.
    """
    report = progress or (lambda event: None)
    source = GGUFFile.open(source_path)
    try:
        chosen = plan(source, preset, allow_requantize)
        writer = gguf.GGUFWriter(target_path, source.architecture)
        try:
            _copy_metadata(source, writer, preset)
            for info in source.tensors.values():
                new = chosen.types[info.name]
                writer.add_tensor_info(info.name, info.shape, np.dtype(np.float32), _nbytes(info.shape, new), raw_dtype=new)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            status = f"quantizing {chosen.source_type} model to {preset.name}"
            total, done = sum(info.nbytes for info in source.tensors.values()), 0
            report({"status": status, "total": total, "completed": 0})
            for info in source.tensors.values():
                writer.write_tensor_data(convert_tensor(source, info.name, chosen.types[info.name]))
                done += info.nbytes
                report({"status": status, "total": total, "completed": done})
        except BaseException:
            writer.close()
            Path(target_path).unlink(missing_ok=True)  # no half-written file is left behind
            raise
        writer.close()
    finally:
        source.close()
    return chosen


def convert_tensor(source: GGUFFile, name: str, qtype: Q) -> np.ndarray:
    """The bytes of tensor `name` as type `qtype` ([rows, row_bytes] uint8)."""
    info = source.tensors[name]
    raw = source.raw(name)
    if qtype == info.qtype:
        return raw
    values = as_float32(raw, info.qtype).reshape(-1, info.shape[-1])
    if not np.isfinite(values).all():  # llama-quantize's loader refuses such data too
        del raw, values  # a traceback holding views of the file's mapping would keep it from closing
        raise QuantizeError(f"tensor {name} has NaN or infinite values: the model is corrupt")
    if qtype in _K_TYPES:
        return kquants.quantize_k(values, _K_TYPES[qtype])
    if qtype in _GGUF_PY_TYPES:
        return _ggml_signed_zeros(gguf.quants.quantize(values, qtype), values, qtype)
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == Q.F32:
        return values.view(np.uint8)
    raise QuantizeError(f"corral cannot write tensors of type {qtype.name}")


def _ggml_signed_zeros(quantized: np.ndarray, values: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf-py's Q4_0/Q4_1/Q5_0/Q5_1 bytes with ggml's sign on zero scales and mins, in place.

    gguf-py and ggml part only there: ggml's Q4_0/Q5_0 scale of an all-zero block is always -0 (its
    running max starts at +0), its Q4_1/Q5_1 scale is +0 whenever it is zero (max - min of equal
    numbers), and its min is the block's first element equal to the minimum, with that element's sign;
    numpy picks either zero.
    """
    block, size = GGML_QUANT_SIZES[qtype]
    out = quantized.reshape(-1, size)
    blocks = values.reshape(-1, block)
    if qtype in (Q.Q4_0, Q.Q5_0):
        out[~np.any(blocks != 0, axis=1), 0:2] = (0x00, 0x80)  # fp16 -0.0, little-endian
    elif qtype in (Q.Q4_1, Q.Q5_1):
        zero_scale = (out[:, 0] == 0) & ((out[:, 1] & 0x7F) == 0)
        out[zero_scale, 1] = 0
        first_min = blocks[np.arange(blocks.shape[0]), np.argmin(blocks, axis=1)]
        out[:, 2:4] = first_min.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return quantized


def as_float32(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """[rows, row_bytes] of `qtype` -> float32 values [rows, columns], exact for F16 and BF16."""
    if qtype == Q.F32:
        return raw.view(np.float32)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return gguf.quants.dequantize(raw, qtype)


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * type_size


def _copy_metadata(source: GGUFFile, writer: gguf.GGUFWriter, preset: Preset) -> None:
    """Every key of the source with its type, in order; the quantization keys set as llama-quantize sets
    them (in their place when the source has them, else at the end)."""
    types = metadata_types(source.path)
    replaced = {"general.quantization_version": QUANTIZATION_VERSION, "general.file_type": int(preset.file_type)}
    for key, value in source.metadata.items():
        if key == "general.architecture":
            continue  # GGUFWriter writes it first
        if key == "general.alignment":
            writer.data_alignment = int(value)
        vtype, item_type = types[key]
        if key in replaced:
            value, vtype, item_type = replaced.pop(key), GGUFValueType.UINT32, None
        if vtype == GGUFValueType.ARRAY:
            value = value.tolist() if isinstance(value, np.ndarray) else list(value)
            if not value:
                continue  # GGUFWriter cannot write an empty array; llama.cpp reads a missing one the same way
        writer.add_key_value(key, value, vtype, sub_type=item_type)
    for key, value in replaced.items():
        writer.add_key_value(key, value, GGUFValueType.UINT32)


_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


def metadata_types(path: str | os.PathLike) -> dict[str, tuple[GGUFValueType, GGUFValueType | None]]:
    """Each metadata key's GGUF value type (and item type of an array), read from the file's header.

    `GGUFFile` keeps values as Python values, which lose the width of an integer; gguf's GGUFReader
    keeps it but builds a numpy view per array item (seconds for a large vocabulary). This walks the
    header and skips over values, reading only types and lengths.
    """
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        count = struct.unpack_from("<Q", data, 16)[0]
        pos, types = 24, {}
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", data, pos)
            key = bytes(data[pos + 8 : pos + 8 + length]).decode("utf-8")
            pos += 8 + length
            vtype = GGUFValueType(struct.unpack_from("<I", data, pos)[0])
            pos += 4
            item_type = None
            if vtype == GGUFValueType.ARRAY:
                item_type = GGUFValueType(struct.unpack_from("<I", data, pos)[0])
                (items,) = struct.unpack_from("<Q", data, pos + 4)
                pos += 12
                if item_type == GGUFValueType.STRING:
                    for _ in range(items):
                        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                else:
                    pos += items * _value_size(item_type)
            elif vtype == GGUFValueType.STRING:
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            else:
                pos += _value_size(vtype)
            types[key] = (vtype, item_type)
    return types


def _value_size(vtype: GGUFValueType) -> int:
    if vtype not in _SIZES:
        raise QuantizeError(f"cannot copy metadata of GGUF type {vtype.name} (nested arrays are not supported)")
    return _SIZES[vtype]

