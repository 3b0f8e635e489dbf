"""The PyTorch backend: CPU and CUDA.

Weights (precision "auto"): Q4_0, Q4_1 and Q4_K linears stay 4-bit, packed for torch's int4
group-32 kernel with bf16 activations. Other linears (Q5_0, Q6_K, Q8_0, F16, ...), embeddings and
the logits projection are dequantized once at load to float32 on CPU (fp32 BLAS is 2-10x faster
than its bf16 path here, and logits are not rounded to bf16, which flips near-tie argmaxes) and
to bf16 on CUDA. Precision "fp32" dequantizes everything to float32: the reference mode. The
residual stream, norms and rope run in float32 either way. Measurements: BENCHMARKS.md.

Batch invariance: a sequence's output must not depend on what it is batched with. The int4
kernel and the attention (one call per sequence over its own cache region) already give each row
the same bits whatever the batch; BLAS does not (it picks its algorithm by the row count), so a
dense linear runs each sequence's prompt chunk as its own call and single rows in chunks of 2..8,
which measured bit-identical for any chunk size.

Graphs are recorded as a list of (function, arguments) nodes and run eagerly by `compute()`; the
recording is what lets a later step compile or replay decode-shaped graphs without model changes.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from corral.errors import UnsupportedTensorTypeError
from corral.gguf import GGUFFile, TensorInfo
from corral.model import Batch
from corral.hookspecs import hookimpl
from corral.plugins.backends import torch_quant

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
PRECISIONS = ("auto", "fp32")


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)


@attrs.frozen
class Int4Weight:
    """A linear weight kept 4-bit: torch's packed int4 layout plus per-group scales and zeros."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int
    in_features: int


def _raw_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    with warnings.catch_warnings():
        # The mapping is read-only; conversions below always produce new tensors.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(info.name))


class TorchBackend:
    """Loads GGUF tensors into torch layouts and runs recorded graphs."""

    name = "torch"

    def __init__(self, device: str | None = None, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = precision
        reference = precision == "fp32"
        dense = torch.bfloat16 if self.device.type == "cuda" and not reference else torch.float32
        self.dtypes = {"linear": dense, "logits": torch.float32, "embedding": torch.float32, "vector": torch.float32}
        self.kv_dtype = torch.float32 if reference else torch.bfloat16
        self._dense: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str) -> Any:
        """Convert one GGUF tensor for `role` ("linear", "embedding" or "vector")."""
        if info.qtype not in torch_quant.DEQUANTIZERS:
            raise UnsupportedTensorTypeError(
                f"{gguf.path}: tensor '{info.name}' has type {getattr(info.qtype, 'name', info.qtype)}, which the "
                f"torch backend cannot load (it loads {', '.join(t.name for t in torch_quant.DEQUANTIZERS)})"
            )
        raw = _raw_tensor(gguf, info)
        cols = info.shape[-1]
        if role == "linear" and self._keeps_int4(info):
            codes, scales, zeros = torch_quant.int4_codes(raw, info.qtype, cols)
            return self._pack_int4(codes, scales, zeros)
        dtype = self.dtypes[role]
        # A tied embedding is bound as "embedding" and as "linear": one dense copy serves both.
        key = (info.name, dtype)
        if key not in self._dense:
            self._dense[key] = torch_quant.dequantize(raw, info.qtype, cols, dtype=dtype).reshape(info.shape).to(self.device)
        return self._dense[key]

    def _keeps_int4(self, info: TensorInfo) -> bool:
        if self.precision != "auto" or info.qtype not in INT4_TYPES or len(info.shape) != 2:
            return False
        # The packed kernels tile output rows by 16 on CPU and 8 on CUDA; others are dequantized.
        rows_multiple = 8 if self.device.type == "cuda" else 16
        return info.shape[0] % rows_multiple == 0 and info.shape[1] % torch_quant.INT4_GROUP == 0

    def _pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weight:
        out_features, in_features = codes.shape
        if self.device.type == "cuda":
            packed, sz = torch_quant.pack_int4_for_cuda(codes.to(self.device), scales.to(self.device), zeros.to(self.device))
        else:
            packed, sz = torch_quant.pack_int4_for_cpu(codes, scales, zeros)
        return Int4Weight(packed, sz, out_features, in_features)

    def set_threads(self, count: int) -> None:
        """Compute threads for CPU kernels (torch's setting is process-wide)."""
        torch.set_num_threads(count)

    def new_context(self, batch: Batch | None = None) -> TorchContext:
        return TorchContext(self, batch)

    def kv_buffer(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.kv_dtype, device=self.device)

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().to(device="cpu", dtype=torch.float32).numpy()

    def weight_bytes(self, weight: Any) -> int:
        if isinstance(weight, Int4Weight):
            return weight.packed.nbytes + weight.scales_and_zeros.nbytes
        return weight.nbytes


class Node:
    """A recorded op's output; supports `+` and `*` for readable model code."""

    __slots__ = ("ctx", "index")

    def __init__(self, ctx: TorchContext, index: int):
        self.ctx, self.index = ctx, index

    def __add__(self, other: Node) -> Node:
        return self.ctx.record(torch.add, self, other)

    def __mul__(self, other: Node) -> Node:
        return self.ctx.record(torch.mul, self, other)


class TorchContext:
    """Records ops as nodes; `compute()` replays them in order under inference mode."""

    def __init__(self, backend: TorchBackend, batch: Batch | None = None):
        self.backend = backend
        self.nodes: list[tuple[Callable, tuple]] = []
        self.row_runs = _sequence_runs(batch) if batch is not None else None
        self._rope_tables: dict[tuple, Node] = {}

    def record(self, fn: Callable, *args: Any) -> Node:
        self.nodes.append((fn, args))
        return Node(self, len(self.nodes) - 1)

    def compute(self, *outputs: Node) -> list[torch.Tensor]:
        values: list[Any] = []
        with torch.inference_mode():
            for fn, args in self.nodes:
                values.append(fn(*(values[a.index] if isinstance(a, Node) else a for a in args)))
        return [values[out.index] for out in outputs]

    # --- ops -------------------------------------------------------------------------------
    def input(self, values: np.ndarray) -> Node:
        return self.record(lambda: self.backend.from_numpy(np.asarray(values, dtype=np.int64)))

    def embedding(self, weight: torch.Tensor, ids: Node) -> Node:
        return self.record(lambda w, i: F.embedding(i, w).float(), weight, ids)

    def linear(self, x: Node, weight: Any, bias: Any = None) -> Node:
        if isinstance(weight, Int4Weight):
            return self.record(_int4_linear, x, weight, bias)
        return self.record(_dense_linear, x, weight, bias, self.row_runs)

    def rms_norm(self, x: Node, weight: torch.Tensor, eps: float) -> Node:
        return self.record(lambda t, w: F.rms_norm(t, (t.shape[-1],), w, eps), x, weight)

    def layer_norm(self, x: Node, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> Node:
        return self.record(lambda t, w, b: F.layer_norm(t, (t.shape[-1],), w, b, eps), x, weight, bias)

    def rope(self, x: Node, positions: Node, *, dims: int, base: float, scale: float = 1.0, neox: bool) -> Node:
        # Every layer rotates by the same positions: build each cos/sin table once per graph.
        key = (positions.index, dims, base, scale)
        if key not in self._rope_tables:
            self._rope_tables[key] = self.record(_rope_table, positions, dims, base, scale)
        return self.record(_rope, x, self._rope_tables[key], dims, neox)

    def attention(self, q: Node, k: Node, v: Node, cache: Any, layer: int, scale: float) -> Node:
        return self.record(_attention, q, k, v, cache, layer, scale)

    def cached_keys(self, keys: Any, cells: Node) -> Node:
        return self.record(_cached_keys, keys, cells)

    def store_keys(self, keys: Any, cells: Node, new: Node) -> Node:
        return self.record(_store_keys, keys, cells, new)

    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        return self.record(torch.reshape, x, tuple(shape))

    def rows(self, x: Node, indices: Node) -> Node:
        return self.record(torch.index_select, x, 0, indices)

    def split(self, x: Node, sizes: Sequence[int], dim: int = -1) -> tuple[Node, ...]:
        parts = self.record(torch.split, x, list(sizes), dim)
        return tuple(self.record(operator.getitem, parts, i) for i in range(len(sizes)))

    def scale(self, x: Node, factor: float) -> Node:
        return self.record(torch.mul, x, factor)

    def silu(self, x: Node) -> Node:
        return self.record(F.silu, x)

    def gelu(self, x: Node, approximate: str = "tanh") -> Node:
        return self.record(lambda t: F.gelu(t, approximate=approximate), x)


def _sequence_runs(batch: Batch) -> list[tuple[int, int]]:
    """[start, stop) row ranges of consecutive rows of one sequence."""
    seqs = batch.sequences
    cuts = [0] + [i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1]] + [len(seqs)]
    return list(zip(cuts[:-1], cuts[1:]))


SINGLES_CHUNK = 8


def _dense_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, runs: list[tuple[int, int]] | None
) -> torch.Tensor:
    # Batch invariance (see the module docstring): a multi-row run of one sequence (a prompt chunk)
    # gets a call of its own; single rows (decode tokens, selected outputs) go in chunks of 2..8.
    xd = x.to(w.dtype)
    if runs is None or sum(stop - start for start, stop in runs) != x.shape[0]:
        runs = [(i, i + 1) for i in range(x.shape[0])]
    out = xd.new_empty((x.shape[0], w.shape[0]))
    singles = [start for start, stop in runs if stop - start == 1]
    for start, stop in runs:
        if stop - start > 1:
            out[start:stop] = F.linear(xd[start:stop], w)
    for i in range(0, len(singles), SINGLES_CHUNK):
        rows = singles[i : i + SINGLES_CHUNK]
        padded = rows if len(rows) > 1 else rows * 2  # one row alone would take the gemv path
        out[rows] = F.linear(xd[padded], w)[: len(rows)]
    y = out.float()
    return y if bias is None else y + bias


def _int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    xb = x.to(torch.bfloat16)
    if xb.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(xb, w.packed, torch_quant.INT4_GROUP, w.scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, torch_quant.INT4_GROUP, w.scales_and_zeros)
    y = y.float()
    return y if bias is None else y + bias


def _rope_table(positions: torch.Tensor, dims: int, base: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, device=positions.device, dtype=torch.float32) / dims))
    angles = (positions.float() * scale)[:, None] * inv_freq[None, :]  # [n, dims/2]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], dims: int, neox: bool) -> torch.Tensor:
    # x: [n, heads, head_dim]; only the first `dims` features rotate.
    cos, sin = table
    rot, rest = x[..., :dims], x[..., dims:]
    if neox:
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    else:
        pairs = rot.unflatten(-1, (dims // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, layer: int, scale: float) -> torch.Tensor:
    keys, values = cache.keys(layer), cache.values(layer)  # [kv_heads, cells, dim]
    slots = cache.layer_slots(layer)
    keys.index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
    values.index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))
    gqa = q.shape[1] != k.shape[1]
    out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
    # One call per sequence over its own cells only: its result never depends on the batch.
    for group in cache.layer_groups(layer):
        end = group.start + group.used
        attended = F.scaled_dot_product_attention(
            q[group.rows].transpose(0, 1).unsqueeze(0).to(keys.dtype),
            keys[:, group.start : end].unsqueeze(0),
            values[:, group.start : end].unsqueeze(0),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out[group.rows] = attended[0].transpose(0, 1).to(out.dtype)
    return out.reshape(q.shape[0], -1)


def _cached_keys(keys: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    return keys.index_select(1, cells).transpose(0, 1).float()


def _store_keys(keys: torch.Tensor, cells: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    keys.index_copy_(1, cells, new.transpose(0, 1).to(keys.dtype))
    return keys
