"""The torch backend: GGUF tensors loaded into the layouts of layouts.py, contexts created, graphs run."""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from corral.errors import UnsupportedTensorTypeError
from corral.gguf import GGUFFile, TensorInfo
from corral.model import Batch
from corral.plugins.backends.torch import native
from corral.plugins.backends.torch.context import TorchContext
from corral.plugins.backends.torch.dequantize import DEQUANTIZERS, INT4_GROUP, dequantize, int4_blocks
from corral.plugins.backends.torch.fusion import stack_weights
from corral.plugins.backends.torch.graph import GraphCache
from corral.plugins.backends.torch.int4_packing import pack_int4_for_cpu, pack_int4_for_cuda
from corral.plugins.backends.torch.layouts import DenseWeight, Int4Blocks, Int4Weight, Int8Weight, MappedRows, RescoredLogits, requantized_int4

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
PRECISIONS = ("auto", "fp32")


def _raw_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    with warnings.catch_warnings():
        # The mapping is read-only; conversions below always produce new tensors.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(info.name))


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
        self._dense: dict[str, torch.Tensor] = {}
        self._graphs = GraphCache()
        self._stacked: dict[tuple[int, ...], tuple[Any, list[Any]]] = {}

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str) -> Any:
        """Convert one GGUF tensor for `role` ("linear", "logits", "embedding" or "vector")."""
        if info.qtype not in DEQUANTIZERS:
            raise UnsupportedTensorTypeError(
                f"{gguf.path}: tensor '{info.name}' has type {getattr(info.qtype, 'name', info.qtype)}, which the "
                f"torch backend cannot load (it loads {', '.join(t.name for t in DEQUANTIZERS)})"
            )
        raw = _raw_tensor(gguf, info)
        cols = info.shape[-1]
        cpu = self.device.type == "cpu"
        if role == "vector":
            return dequantize(raw, info.qtype, cols).reshape(info.shape).to(self.device)
        if role == "embedding" and cpu:
            return MappedRows(raw, info.qtype, cols)
        if role == "linear" and self._keeps_int4(info):
            codes, scales, mins = int4_blocks(raw, info.qtype, cols)
            return self._pack_int4(codes, scales, mins, MappedRows(raw, info.qtype, cols) if cpu else None)
        if self._keeps_int8(info) and cpu:
            if role == "logits":
                return RescoredLogits(self._approximate_logits(raw, info), MappedRows(raw, info.qtype, cols))
            return Int8Weight.from_gguf(raw, info.qtype, cols)
        dtype = torch.float32 if role in ("logits", "embedding") else self.dense_dtype
        dense = self._dequantized(info, raw, dtype)
        return dense if role == "embedding" else DenseWeight(dense)

    def _dequantized(self, info: TensorInfo, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A tied embedding is bound as "embedding" and as "logits": one dense copy serves both.
        key = f"{info.name}:{dtype}"
        if key not in self._dense:
            self._dense[key] = dequantize(raw, info.qtype, info.shape[-1], dtype=dtype).reshape(info.shape).to(self.device)
        return self._dense[key]

    def _keeps_int4(self, info: TensorInfo) -> bool:
        if self.precision != "auto" or info.qtype not in INT4_TYPES or len(info.shape) != 2:
            return False
        # The packed kernels tile output rows by 16 on CPU and 8 on CUDA; others are dequantized.
        rows_multiple = 8 if self.device.type == "cuda" else 16
        return info.shape[0] % rows_multiple == 0 and info.shape[1] % INT4_GROUP == 0

    def _approximate_logits(self, raw: torch.Tensor, info: TensorInfo) -> Int4Weight | Int8Weight:
        rows, cols = info.shape
        if rows % 16 == 0 and cols % INT4_GROUP == 0:  # the CPU int4 kernel's shapes
            return requantized_int4(raw, info.qtype, cols)
        return Int8Weight.from_gguf(raw, info.qtype, cols)

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

    def set_threads(self, count: int) -> None:
        """Compute threads for CPU kernels (torch's setting is process-wide)."""
        torch.set_num_threads(count)

    def new_context(self, batch: Batch | None = None, view: Any = None) -> TorchContext:
        return TorchContext(self, batch, view)

    def run(self, model: Any, batch: Batch, view: Any) -> torch.Tensor:
        """The logits of `batch` through `model`; a graph recorded for a batch of this shape is reused."""
        return self._graphs.run(model, batch, view, self.new_context)

    def kv_buffer(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.kv_dtype, device=self.device)

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().to(device="cpu", dtype=torch.float32).numpy()

    def weight_bytes(self, weight: Any) -> int:
        return weight.nbytes
