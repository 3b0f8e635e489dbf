"""Open a GGUF file: typed metadata and memory-mapped tensor data.

The header is parsed here with `struct` over an mmap, using the format's type tables (corral.ggml_types).
`gguf.GGUFReader` builds a numpy view per array element, which takes seconds for a large
vocabulary; this reader is hundreds of times faster (measured: BENCHMARKS.md, core/gguf.py).
Tensor bytes are never copied: `GGUFFile.raw()` returns a view into the mapping.

Neither numpy nor the `gguf` package is imported here: the routing server reads headers (model
loads, /api/show, /api/tags) and stays ~22 MiB smaller without them. `raw()`, which only runners
and converters call, imports numpy when it is called.
"""

from __future__ import annotations

import math
import mmap
import os
import pathlib
import struct
from typing import TYPE_CHECKING, Any

import attrs

from corral.errors import GGUFError, NotGGUFError, TruncatedGGUFError
from corral.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

if TYPE_CHECKING:
    import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


_U64 = struct.Struct("<Q")
# The fewest bytes one item can take, to refuse a forged count before looping over it: a key-value pair
# (key length + value type), a tensor's info (name length, dimension count, type, offset), an array's item.
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 12, 24
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
MAX_ARRAY_DEPTH = 4  # arrays of arrays: real files nest none; a forged file could nest until the stack overflows


@attrs.frozen
class TensorInfo:
    """Where one tensor lives in the file; `shape` is in torch order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one innermost row."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * type_size


class _Cursor:
    """Reads little-endian GGUF values from a buffer, raising TruncatedGGUFError past its end."""

    def __init__(self, buf: memoryview, path: pathlib.Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.depth = 0

    def expect(self, count: int, item_bytes: int) -> None:
        """Refuse `count` items of at least `item_bytes` each that cannot fit in the rest of the file."""
        if count * item_bytes > len(self.buf) - self.pos:
            raise TruncatedGGUFError(f"{self.path}: the header claims {count} items, more than the file holds (corrupt or truncated?)")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise TruncatedGGUFError(f"{self.path}: file ends inside the GGUF header (truncated download?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        start = self.pos + 8
        if start > len(self.buf):
            raise TruncatedGGUFError(f"{self.path}: file ends inside the GGUF header (truncated download?)")
        (length,) = _U64.unpack_from(self.buf, self.pos)
        end = start + length
        if end > len(self.buf):
            raise TruncatedGGUFError(f"{self.path}: file ends inside the GGUF header (truncated download?)")
        self.pos = end
        return str(self.buf[start:end], "utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}; the file may be corrupt") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.take(_SCALAR_FORMATS[vtype])

    def array(self) -> list:
        item_type = self.take("<I")
        count = self.take("<Q")
        if item_type == GGUFValueType.ARRAY and self.depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: metadata arrays nested deeper than {MAX_ARRAY_DEPTH}; the file is corrupt")
        self.expect(count, _MIN_ITEM_BYTES.get(item_type, 1))
        fmt = _SCALAR_FORMATS.get(GGUFValueType(item_type)) if item_type in GGUFValueType._value2member_map_ else None
        if fmt is not None:
            # Numeric arrays (token scores, types) are read in one go: one struct call for the whole array.
            size = struct.calcsize(fmt) * count
            if self.pos + size > len(self.buf):
                raise TruncatedGGUFError(f"{self.path}: file ends inside the GGUF header (truncated download?)")
            values = list(struct.unpack_from(f"<{count}{fmt[1:]}", self.buf, self.pos))
            self.pos += size
            return values
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        self.depth += 1
        try:
            return [self.value(item_type) for _ in range(count)]
        finally:
            self.depth -= 1


@attrs.define
class GGUFFile:
    """A memory-mapped GGUF file: `metadata` (key -> Python value) and `tensors` (name -> TensorInfo)."""

    path: pathlib.Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _mmap: mmap.mmap = attrs.field(repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        """Map the file and parse its header; raise a GGUFError subclass when it is not a usable GGUF."""
        path = pathlib.Path(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise NotGGUFError(f"{path}: not a GGUF file (only {size} bytes)")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if mapping[:4] != GGUF_MAGIC:
            mapping.close()
            raise NotGGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        return cls._parse(path, mapping)

    @classmethod
    def _parse(cls, path: pathlib.Path, mapping: mmap.mmap) -> GGUFFile:
        cur = _Cursor(memoryview(mapping), path)
        cur.pos = 4
        version = cur.take("<I")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
        tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
        cur.expect(kv_count, _MIN_KV_BYTES)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            metadata[key] = cur.value(cur.take("<I"))
        cur.expect(tensor_count, _MIN_TENSOR_INFO_BYTES)
        infos = [cls._tensor_info(cur) for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment must be a positive power of two, not {alignment!r}; the file is corrupt")
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, rel in infos:
            info = TensorInfo(name, shape, qtype, data_start + rel, _nbytes(path, name, shape, qtype))
            if info.offset + info.nbytes > len(mapping):
                raise TruncatedGGUFError(
                    f"{path}: tensor '{name}' extends past the end of the file (truncated download?)"
                )
            tensors[name] = info
        return cls(path, version, metadata, tensors, mapping)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise GGUFError(f"{cur.path}: tensor '{name}' claims {n_dims} dimensions; the file is corrupt")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        raw_type = cur.take("<I")
        offset = cur.take("<Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            qtype = raw_type  # reported by the backend as an unsupported type when it is used
        return name, tuple(reversed(dims)), qtype, offset

    @property
    def architecture(self) -> str:
        """The `general.architecture` key."""
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        try:
            return self.metadata[key]
        except KeyError:
            raise GGUFError(f"{self.path}: metadata key '{key}' is missing") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows, row_bytes] viewing the mapping."""
        import numpy as np  # runners and converters read tensors; the routing server, which only reads headers, never does

        info = self.tensors[name]
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        flat = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(rows, info.nbytes // rows if rows else 0)

    def drop_resident_pages(self) -> None:
        """Let the kernel drop this process's copy of the file's pages (they reload from the file when read).

        After the backend has converted the weights, only a few rows (embeddings looked up,
        logits rescored) are read again: keeping the whole file resident would only inflate RSS.
        """
        self._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Release the mapping (views handed out earlier become invalid)."""
        self._mmap.close()


def _nbytes(path: pathlib.Path, name: str, shape: tuple[int, ...], qtype: Any) -> int:
    if qtype not in GGML_QUANT_SIZES:
        return 0
    block, type_size = GGML_QUANT_SIZES[qtype]
    count = math.prod(shape)  # Python integers: a forged shape cannot overflow into a small (or negative) size
    if shape and shape[-1] % block:
        raise GGUFError(f"{path}: tensor '{name}' row of {shape[-1]} is not a multiple of its block size {block}")
    return count // block * type_size
