"""The torch backend: GGUF tensors loaded into the layouts of layouts.py, contexts created, graphs run."""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import attrs
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from corral.errors import UnsupportedTensorTypeError
from corral.kvcache import UnsupportedKVCacheTypeError
from corral.gguf import GGUFFile, TensorInfo
from corral.ml import Rope
from corral.model import Batch
from corral.parallel.shards import Shard, TensorParallel
from corral.plugins.backends.torch import native
from corral.plugins.backends.torch.context import TorchContext, _rope_table
from corral.plugins.backends.torch.dequantize import DEQUANTIZERS, INT4_GROUP, dequantize, int4_blocks
from corral.plugins.backends.torch.experts import ExpertWeights
from corral.plugins.backends.torch.fusion import stack_weights
from corral.plugins.backends.torch.graph import GraphCache
from corral.plugins.backends.torch.kv_cells import QuantizedCells, refusal
from corral.plugins.backends.torch.int4_packing import pack_int4_for_cpu, pack_int4_for_cuda
from corral.plugins.backends.torch.sharding import shard_tensor
from corral.plugins.backends.torch.layouts import DenseWeight, Int4Blocks, Int4Columns, Int4Weight, Int8Weight, MappedRows, RescoredLogits, requantized_int4
from corral.plugins.backends.torch.rope import RopeRows

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
HALF_SCALE_TYPES = frozenset({Q.Q4_0, Q.Q4_1})  # their scales and mins are float16 in the file: exact in it
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
PRECISIONS = ("auto", "fp32")
COMPUTE_CODE_BYTES = 16 << 20  # see TorchBackend.compute_overhead_bytes


def _raw_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    with warnings.catch_warnings():
        # The mapping is read-only; conversions below always produce new tensors.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(info.name))


def expert_infos(info: TensorInfo) -> list[TensorInfo]:
    """A 3-D expert tensor [experts, out, in] as one 2-D linear per expert (its rows of the file)."""
    if len(info.shape) != 3:
        raise UnsupportedTensorTypeError(f"tensor '{info.name}' of shape {list(info.shape)} is not a stack of experts [experts, out, in]")
    count, size = info.shape[0], info.nbytes // info.shape[0]
    return [attrs.evolve(info, name=f"{info.name}[{e}]", shape=info.shape[1:], offset=info.offset + e * size, nbytes=size) for e in range(count)]


def approximates_in_int4(rows: int, cols: int) -> bool:
    """Whether the vocabulary projection's approximate copy is int4 (the CPU int4 kernels' shapes), else int8."""
    return rows % 16 == 0 and cols % INT4_GROUP == 0


def predicted_bytes(layout: str, info: TensorInfo) -> int:
    """Bytes of one tensor in a non-dense `layout` (see `TorchBackend.layout`), from its type and shape."""
    count = math.prod(info.shape)
    rows, cols = (info.shape[0], count // info.shape[0]) if info.shape else (1, 1)
    groups = count // INT4_GROUP
    if layout == "vector":
        return 4 * count
    if layout == "mapped":
        return 0  # the file's pages
    if layout == "int4_blocks":  # nibbles, a scale and a min per group (float16 where exact in it)
        return count // 2 + 2 * groups * (2 if info.qtype in HALF_SCALE_TYPES else 4)
    if layout == "int4_packed":  # nibbles, bf16 scale and zero per group
        return count // 2 + 2 * groups * 2
    if layout == "rescored":  # the approximate copy: int4 with 16-bit group values, else int8 (rows from the file)
        return count // 2 + 2 * groups * 2 if approximates_in_int4(rows, cols) else count + 2 * rows
    if layout == "int8":  # codes and a bf16 scale per row
        return count + 2 * rows
    raise ValueError(f"unknown layout {layout!r}")


def _check_quantized_shape(cache_type: str, shape: Sequence[int]) -> None:
    if (reason := refusal(cache_type, tuple(shape))) is not None:
        raise UnsupportedKVCacheTypeError(cache_type, reason)


class TorchBackend:
    """Loads GGUF tensors into torch layouts (layouts.py) and runs recorded graphs."""

    name = "torch"

    def __init__(self, device: str | None = None, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = precision
        reference = precision == "fp32"
        self.dense_dtype = torch.bfloat16 if self.device.type == "cuda" and not reference else torch.float32
        self.kv_dtype = torch.float32 if reference else torch.bfloat16
        self._dense: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}  # (file, tensor, dtype) -> its dense copy
        self._graphs = GraphCache()
        self._stacked: dict[tuple[int, ...], tuple[Any, list[Any]]] = {}
        self._rope_rows: dict[tuple, RopeRows] = {}  # (rope, its factors' ids) -> its table (rope.py)
        # This process's rank of a tensor-parallel model (core/parallel/); None: the whole model here.
        self.parallel: TensorParallel | None = None
        self.stage: Any = None  # this process's pipeline stage (core/parallel/pipeline.py); None: every block here

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str, shard: Shard | None = None) -> Any:
        """Convert one GGUF tensor for `role` ("linear", "logits", "embedding", "vector" or "experts");
        with `shard`, only this tensor-parallel rank's part of it."""
        raw = _raw_tensor(gguf, info)
        if shard is not None:
            raw, info = shard_tensor(raw, info, shard)
        if role == "experts":
            parts = expert_infos(info)
            rows = parts[0].shape[0]
            return ExpertWeights(tuple(self._convert(raw[e * rows : (e + 1) * rows], part, "linear", gguf.path) for e, part in enumerate(parts)))
        return self._convert(raw, info, role, gguf.path)

    def _convert(self, raw: torch.Tensor, info: TensorInfo, role: str, path: Any) -> Any:
        """One tensor's bytes [rows, row_bytes] in the layout `role` takes."""
        layout = self.layout(info, role, path)
        cols = info.shape[-1]
        cpu = self.device.type == "cpu"
        if layout == "vector":
            return dequantize(raw, info.qtype, cols).reshape(info.shape).to(self.device)
        if layout == "mapped":
            return MappedRows(raw, info.qtype, cols)
        if layout in ("int4_blocks", "int4_packed"):
            codes, scales, mins = int4_blocks(raw, info.qtype, cols)
            return self._pack_int4(codes, scales, mins, MappedRows(raw, info.qtype, cols) if cpu else None)
        if layout == "rescored":
            return RescoredLogits(self._approximate_logits(raw, info), MappedRows(raw, info.qtype, cols))
        if layout == "int8":
            return Int8Weight.from_gguf(raw, info.qtype, cols)
        dense = self._dequantized(info, raw, self._dense_dtype(role), path)
        return dense if role == "embedding" else DenseWeight(dense)

    def layout(self, info: TensorInfo, role: str, path: Any = "") -> str:
        """Which layout `load_tensor` gives the tensor for `role`: the one decision both it and `resident_bytes` use."""
        if info.qtype not in DEQUANTIZERS:
            raise UnsupportedTensorTypeError(
                f"{path}: tensor '{info.name}' has type {getattr(info.qtype, 'name', info.qtype)}, which the "
                f"torch backend cannot load (it loads {', '.join(t.name for t in DEQUANTIZERS)})"
            )
        cpu = self.device.type == "cpu"
        if role == "vector":
            return "vector"
        if role == "embedding" and cpu:
            return "mapped"
        if role == "linear" and self._keeps_int4(info):
            return "int4_blocks" if cpu and Int4Blocks.takes(*info.shape) else "int4_packed"
        if self._keeps_int8(info) and cpu:
            return "rescored" if role == "logits" else "int8"
        return "dense"

    def resident_bytes(self, tensors: Sequence[tuple[TensorInfo, str]]) -> int:
        """Memory loading these (tensor, role) pairs would occupy, predicted from types and shapes alone."""
        dense_seen, total = set(), 0
        experts = [(part, "linear") for info, role in tensors if role == "experts" for part in expert_infos(info)]
        for info, role in [pair for pair in tensors if pair[1] != "experts"] + experts:
            layout = self.layout(info, role)
            if layout == "dense":
                key = f"{info.name}:{self._dense_dtype(role)}"  # one dense copy serves a tied embedding's roles
                if key in dense_seen:
                    continue
                dense_seen.add(key)
                total += math.prod(info.shape) * self._dense_dtype(role).itemsize
            else:
                total += predicted_bytes(layout, info)
            if layout == "int4_packed" and self.device.type == "cpu":
                # Its prompt chunks read the file's exact weights (Int4Weight.source): once read, those
                # pages of the memory map stay resident in this process (measured: smollm2's 66 MB).
                total += info.nbytes
        return total

    def available_bytes(self) -> int | None:
        """Free memory on this backend's GPU, what a load there may use; None on CPU (the system's memory decides)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def compute_overhead_bytes(self) -> int:
        """Memory the first computations fault in beyond tensors: the kernels' code pages of libtorch and its
        libraries (measured: 16 MB on CPU after a full prompt, both real models; BENCHMARKS.md "Memory")."""
        return COMPUTE_CODE_BYTES if self.device.type == "cpu" else 0

    def kv_buffer_bytes(self, shape: Sequence[int], cache_type: str = "f16") -> int:
        """Memory `kv_buffer(shape, cache_type)` occupies."""
        if cache_type != "f16":
            _check_quantized_shape(cache_type, shape)
            return QuantizedCells.nbytes_of(cache_type, tuple(shape))
        return math.prod(shape) * self.kv_dtype.itemsize

    def _dense_dtype(self, role: str) -> torch.dtype:
        return torch.float32 if role in ("logits", "embedding") else self.dense_dtype

    def _dequantized(self, info: TensorInfo, raw: torch.Tensor, dtype: torch.dtype, path: Any) -> torch.Tensor:
        # A tied embedding is bound as "embedding" and as "logits": one dense copy serves both. Keyed by
        # the file too: a model and its projector (or two models) on one backend may share tensor names.
        key = (str(path), info.name, dtype)
        if key not in self._dense:
            self._dense[key] = dequantize(raw, info.qtype, info.shape[-1], dtype=dtype).reshape(info.shape).to(self.device)
        return self._dense[key]

    def _keeps_int4(self, info: TensorInfo) -> bool:
        if self.precision != "auto" or info.qtype not in INT4_TYPES or len(info.shape) != 2:
            return False
        # The packed kernels tile output rows by 16 on CPU and 8 on CUDA; others are dequantized.
        rows_multiple = 8 if self.device.type == "cuda" else 16
        return info.shape[0] % rows_multiple == 0 and info.shape[1] % INT4_GROUP == 0

    def _approximate_logits(self, raw: torch.Tensor, info: TensorInfo) -> Int4Columns | Int4Blocks | Int4Weight | Int8Weight:
        if approximates_in_int4(*info.shape):
            return requantized_int4(raw, info.qtype, info.shape[-1], columns=True)
        return Int8Weight.from_gguf(raw, info.qtype, info.shape[-1])

    def _keeps_int8(self, info: TensorInfo) -> bool:
        # Quantized files hold at most 8 bits a weight: int8 per row loses little of it. Float
        # files keep their precision.
        return self.precision == "auto" and info.qtype not in FLOAT_TYPES and len(info.shape) == 2

    def _pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, source: MappedRows | None) -> Int4Blocks | Int4Weight:
        out_features, in_features = codes.shape
        if self.device.type == "cpu" and Int4Blocks.takes(out_features, in_features):
            return Int4Blocks.from_codes(codes, scales, mins)
        zeros = mins + 8 * scales
        if self.device.type == "cuda":
            packed, sz = pack_int4_for_cuda(codes.to(self.device), scales.to(self.device), zeros.to(self.device))
        else:
            packed, sz = pack_int4_for_cpu(codes, scales, zeros)
        return Int4Weight(packed, sz, out_features, in_features, source)

    def stacked_weight(self, weights: list[Any]) -> Any | None:
        """The weights stacked by rows into one (built once per group), or None when they do not stack."""
        key = tuple(id(w) for w in weights)
        if key not in self._stacked:
            self._stacked[key] = (stack_weights(weights), weights)  # the originals kept alive with their key
        return self._stacked[key][0]

    def native(self, name: str) -> bool:
        """Whether the native CPU kernel `name` (native.py) serves this backend."""
        return self.device.type == "cpu" and native.has(name)

    def rope_rows(self, rope: Rope) -> RopeRows:
        """The native rope's table of `rope` (rope.py), shared by every graph of this backend."""
        key = (rope, id(rope.freq_factors), id(rope.long_factors))
        if key not in self._rope_rows:
            self._rope_rows[key] = RopeRows(rope, _rope_table)
        return self._rope_rows[key]

    def set_threads(self, count: int) -> None:
        """Compute threads for CPU kernels (torch's setting is process-wide)."""
        torch.set_num_threads(count)

    def new_context(self, batch: Batch | None = None, view: Any = None) -> TorchContext:
        return TorchContext(self, batch, view)

    def run(self, model: Any, batch: Batch, view: Any) -> torch.Tensor:
        """The logits of `batch` through `model`; a graph recorded for a batch of this shape is reused."""
        return self._graphs.run(model, batch, view, self.new_context)

    def kv_buffer(self, shape: Sequence[int], cache_type: str = "f16") -> torch.Tensor | QuantizedCells:
        """A zeroed cache buffer [kv_heads, cells, dim]; under tensor parallelism, of this rank's KV heads.

        "f16" is a 16-bit float tensor (bfloat16; float32 at precision fp32); "q8_0" and "q4_0" hold
        ggml's blocks (kv_cells.py), read back in that float dtype."""
        if self.parallel is not None:
            shape = self.parallel.kv_shape(shape)
        if cache_type != "f16":
            _check_quantized_shape(cache_type, shape)
            return QuantizedCells(cache_type, tuple(shape), self.kv_dtype, self.device)
        return torch.zeros(tuple(shape), dtype=self.kv_dtype, device=self.device)

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().to(device="cpu", dtype=torch.float32).numpy()

    def weight_bytes(self, weight: Any) -> int:
        return weight.nbytes
