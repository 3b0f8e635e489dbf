"""The torch backend's context: the ops of ml.Context recorded as graph nodes, and the functions they run."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from corral.ml import Rope, Yarn
from corral.model import Batch
from corral.plugins.backends.torch import elementwise, native
from corral.plugins.backends.torch.attention import AttentionMemo, attention, bind_attention
from corral.plugins.backends.torch.bidirectional import bidirectional_attention
from corral.plugins.backends.torch.kv_cells import read_cells, write_cells
from corral.plugins.backends.torch.fusion import VIEW_FUNCTIONS, fuse_gated_halves, fuse_gates, fuse_linears, fuse_norms, fuse_residuals, fuse_ropes, slice_lone_parts
from corral.plugins.backends.torch.graph import VIEW, Graph, Node, Slot
from corral.plugins.backends.torch.layouts import MappedRows
from corral.plugins.backends.torch.rope import RopeRows

if TYPE_CHECKING:
    from corral.plugins.backends.torch.backend import TorchBackend


# Rows up to which a replayed graph's nodes keep their outputs from step to step (bound calls,
# below): decode steps; a prompt chunk's outputs are large and better freed after their last reader.
BOUND_ROWS = 16


class TorchContext(Graph):
    """Records the ops of ml.Context as graph nodes; `compute()` runs them."""

    def __init__(self, backend: TorchBackend, batch: Batch | None = None, view: Any = None):
        super().__init__(batch, view)
        self.backend = backend
        self.parallel = backend.parallel  # nn.py's split layers read it: None, or this rank of a tensor-parallel model
        self._rope_tables: dict[tuple, Node] = {}
        self._attention = AttentionMemo()
        if backend.device.type == "cpu" and batch is not None and len(batch.inputs) <= BOUND_ROWS:
            self.binders = BINDERS  # a replayed plan's native nodes become bound calls (graph.Plan)

    def optimize(self, output: Node) -> Node:
        (output,) = fuse_linears(self, (output,), _linear, self.backend.stacked_weight)
        if self.backend.native("rope_heads"):
            (output,) = fuse_ropes(self, (output,), _native_rope, _rope_columns)
        else:
            (output,) = fuse_ropes(self, (output,), _rope)
        if self.backend.native("gated"):
            (output,) = fuse_gates(self, (output,), {fn: name for name, fn in GATED.items()}, _gated)
            (output,) = fuse_gated_halves(self, (output,), _gated, _gated_halves)
        (output,) = slice_lone_parts(self, (output,))
        if self.backend.native("rms_norm"):
            (output,) = fuse_norms(self, (output,), native.rms_norm, _linear, _normed_linear)
        if self.backend.device.type == "cpu":
            post_norm = native.rms_norm if self.backend.native("rms_norm") else None
            (output,) = fuse_residuals(self, (output,), _linear, post_norm, _added_linear)
        return output

    # --- ops -------------------------------------------------------------------------------
    def input(self, values: np.ndarray) -> Node:
        slot = self.batch_slot(values)
        return self.record(self._input, slot if slot is not None else values)

    def _input(self, values: np.ndarray) -> torch.Tensor:
        return self.backend.from_numpy(np.asarray(values, dtype=np.int64))

    def float_input(self, values: Any) -> Node:
        self.replayable = False  # values of this batch alone (an image's pixels or embeddings): the graph runs once
        return self.record(self._float_input, values)

    def _float_input(self, values: Any) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(device=self.backend.device, dtype=torch.float32)
        return self.backend.from_numpy(np.asarray(values, dtype=np.float32))

    def put_rows(self, x: Node, indices: Node, rows: Node) -> Node:
        return self.record(_put_rows, x, indices, rows)

    def conv2d(self, x: Node, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> Node:
        return self.record(lambda t, w, b: F.conv2d(t.float().unsqueeze(0), w.float(), b, stride=stride)[0], x, weight, bias)

    def permute(self, x: Node, dims: Sequence[int]) -> Node:
        return self.record(torch.permute, x, tuple(dims))

    def matmul(self, x: Node, weight: torch.Tensor) -> Node:
        return self.record(lambda t, w: torch.matmul(t.float(), w.float()), x, weight)

    def embedding(self, weight: Any, ids: Node) -> Node:
        if isinstance(weight, MappedRows):
            return self.record(MappedRows.rows, weight, ids)
        return self.record(lambda w, i: F.embedding(i, w).float(), weight, ids)

    def linear(self, x: Node, weight: Any, bias: Any = None) -> Node:
        return self.record(_linear, x, weight, bias, Slot("runs") if self.batch is not None else None)

    def rms_norm(self, x: Node, weight: torch.Tensor, eps: float) -> Node:
        if self.backend.native("rms_norm") and weight.dtype == torch.float32 and weight.is_contiguous():
            return self.record(native.rms_norm, x, weight, eps)
        return self.record(lambda t, w: F.rms_norm(t.float(), (t.shape[-1],), w, eps), x, weight)

    def layer_norm(self, x: Node, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> Node:
        if weight is not None and weight.dim() > 1:  # one weight row per head: normalise, then scale each head by its own
            return self.record(_layer_norm_per_head, x, weight, bias, eps)
        return self.record(lambda t, w, b: F.layer_norm(t.float(), (t.shape[-1],), w, b, eps), x, weight, bias)

    def rope(self, x: Node, positions: Node, rope: Rope) -> Node:
        # Every layer rotates by the same positions: build each cos/sin table once per graph.
        key = (positions.index, rope, id(rope.freq_factors), id(rope.long_factors))
        if self.backend.native("rope_heads"):  # the table's rows looked up, then one native call a rope
            if key not in self._rope_tables:
                view = Slot("view") if self.batch is not None else self.view
                self._rope_tables[key] = self.record(RopeRows.rows, self.backend.rope_rows(rope), positions, view)
            return self.record(_native_rope, x, self._rope_tables[key], rope.dims, rope.neox)
        if key not in self._rope_tables:
            if rope.long_factors is None:
                self._rope_tables[key] = self.record(_rope_table, positions, rope)
            else:  # LongRoPE: the factors follow the context of the cache view, bound anew when the graph is reused
                view = Slot("view") if self.batch is not None else self.view
                self._rope_tables[key] = self.record(_rope_table, positions, rope, view)
        return self.record(_rope, x, self._rope_tables[key], rope.dims, rope.neox)

    def attention(
        self, q: Node, k: Node, v: Node, cache: Any, layer: int, scale: float, *, softcap: float | None = None, sinks: Any = None
    ) -> Node:
        if cache is not self.view:
            self.replayable = False
        view = Slot("view") if cache is self.view else cache
        return self.record(attention, q, k, v, view, layer, scale, self._attention, softcap, sinks)

    def bidirectional_attention(self, q: Node, k: Node, v: Node, lengths: Sequence[int], scale: float) -> Node:
        self.replayable = False  # the lengths are baked into the graph
        return self.record(bidirectional_attention, q, k, v, tuple(lengths), scale)

    def all_reduce(self, x: Node) -> Node:
        return self.record(self.parallel.all_reduce, x)

    def send(self, x: Node, peer: int) -> Node:
        return self.record(self.backend.stage.send, x, peer)

    def receive(self, peer: int, after: Node | None = None) -> Node:
        return self.record(self.backend.stage.receive, peer, after)

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

    def concat(self, xs: Sequence[Node], dim: int = -1) -> Node:
        return self.record(_concat, dim, *xs)

    def expand(self, x: Node, shape: Sequence[int]) -> Node:
        return self.record(torch.Tensor.expand, x, tuple(shape))

    def scale(self, x: Node, factor: float) -> Node:
        return self.record(torch.mul, x, factor)

    def relu(self, x: Node) -> Node:
        return self.record(F.relu, x)

    def sigmoid(self, x: Node) -> Node:
        return self.record(elementwise.sigmoid, x)

    def softmax(self, x: Node) -> Node:
        return self.record(_softmax, x)

    def softcap(self, x: Node, cap: float) -> Node:
        return self.record(_softcap, x, cap)

    def clamp(self, x: Node, min: float | None = None, max: float | None = None) -> Node:
        return self.record(torch.clamp, x, min, max)

    def sum(self, x: Node, dim: int = -1, keepdim: bool = False) -> Node:
        return self.record(torch.sum, x, dim, keepdim)

    def top_k(self, x: Node, k: int) -> tuple[Node, Node]:
        picked = self.record(_top_k, x, k)
        return self.record(operator.getitem, picked, 0), self.record(operator.getitem, picked, 1)

    def gather(self, x: Node, indices: Node) -> Node:
        return self.record(torch.gather, x, -1, indices)

    def expert_linear(self, x: Node, experts: Any, ids: Node, bias: Any = None) -> Node:
        return self.record(experts.matmul_selected, x, ids, bias, Slot("runs") if self.batch is not None else None)

    def stacked_linear(self, x: Node, weights: Any) -> Node:
        return self.record(weights.matmul_each, x, Slot("runs") if self.batch is not None else None)

    def keep_only(self, x: Node, indices: Node, fill: float = float("-inf")) -> Node:
        return self.record(_keep_only, x, indices, fill)

    def silu(self, x: Node) -> Node:
        return self.record(elementwise.silu, x)

    def gelu(self, x: Node, approximate: str = "tanh") -> Node:
        if approximate == "tanh":
            return self.record(elementwise.gelu_tanh, x)
        if approximate == "none":
            return self.record(elementwise.gelu_erf, x)
        raise ValueError(f"gelu approximation {approximate!r}: 'tanh' or 'none'")


def _put_rows(x: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x.index_copy(0, indices, rows.to(x.dtype))


# The activations a fused gate computes (by native.gated's names), as the graph records them.
GATED = {"silu": elementwise.silu, "gelu_tanh": elementwise.gelu_tanh}


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(gate) * up: natively in one pass for float32 rows on the CPU, else torch's two kernels."""
    if gate.dtype == up.dtype == torch.float32 and gate.device.type == "cpu" and gate.dim() == 2 and gate.stride(1) == up.stride(1) == 1:
        return native.gated(gate, up, activation)
    return GATED[activation](gate) * up


def _gated_halves(y: torch.Tensor, width: int, activation: str) -> torch.Tensor:
    """`_gated` of the two halves of a fused gate/up output y [rows, 2 * width] (fusion.fuse_gated_halves)."""
    if y.dtype == torch.float32 and y.device.type == "cpu" and y.dim() == 2 and y.stride(1) == 1:
        return native.gated_halves(y, width, activation)
    return _gated(y[:, :width], y[:, width:], activation)


def _layer_norm_per_head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * weight
    return y if bias is None else y + bias


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, runs: list[tuple[int, int]] | None) -> torch.Tensor:
    y = weight.matmul(x, runs)
    return y if bias is None else y + bias


def _normed_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: Any, runs: list[tuple[int, int]] | None) -> torch.Tensor:
    """`_linear(native.rms_norm(x, norm, eps), weight, None, runs)` (fusion.fuse_norms)."""
    if x.device.type != "cpu":
        return weight.matmul(native.rms_norm(x, norm, eps), runs)
    return weight.normed_matmul(x, norm, eps, runs)


def _added_linear(
    x: torch.Tensor, weight: Any, residual: torch.Tensor, runs: list[tuple[int, int]] | None, norm: Any, eps: float
) -> torch.Tensor:
    """`residual + _linear(x, weight, None, runs)`, normed by `norm` first where given (fusion.fuse_residuals)."""
    return weight.added_matmul(x, residual, runs, norm, eps)


def _concat(dim: int, *xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.float() for x in xs] if len({x.dtype for x in xs}) > 1 else xs, dim)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return elementwise.tanh(x.float() / cap) * cap


def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Sorted: the slot order sets the order the chosen experts' outputs are summed in.
    return torch.topk(x, k, dim=-1, sorted=True)


def _keep_only(x: torch.Tensor, indices: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.full_like(x, fill).scatter(-1, indices, x.gather(-1, indices))


def _rope_table(positions: torch.Tensor, rope: Rope, view: Any = None) -> Any:
    """The rotation of each position, laid out like the features it turns: for adjacent pairs, the
    complex number attn_factor * e^(i angle) [n, 1, dims/2]; for halves, cos and signed sin [n, 1, dims].
    `view`: the cache view whose context picks LongRoPE's factors (none: the short ones)."""
    dims = rope.dims
    inv_freq = 1.0 / (rope.base ** (torch.arange(0, dims, 2, device=positions.device, dtype=torch.float32) / dims))
    factors = rope.freq_factors
    if rope.long_factors is not None and view is not None and view.context_length > rope.original_context:
        factors = rope.long_factors
    if factors is not None:
        inv_freq = inv_freq / factors.to(positions.device, torch.float32)
    magnitude = rope.attn_factor
    if rope.yarn is None:
        angles = (positions.float() * rope.scale)[:, None] * inv_freq[None, :]  # [n, dims/2]
    else:
        angles, magnitude = _yarn_angles(positions.float()[:, None] * inv_freq[None, :], rope, rope.yarn)
    if rope.rotation_only:
        magnitude = 1.0
    cos, sin = elementwise.cos(angles), elementwise.sin(angles)
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    if not rope.neox:
        return torch.complex(cos, sin)[:, None, :]
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def _yarn_angles(extrapolated: torch.Tensor, rope: Rope, yarn: Yarn) -> tuple[torch.Tensor, float]:
    """YaRN as ggml computes it: pairs below the correction range keep their trained angle, pairs
    above it are interpolated by `scale`, a linear ramp between; the magnitude grows with the scaling."""
    interpolated = extrapolated * rope.scale
    if yarn.ext_factor == 0.0:
        return interpolated, rope.attn_factor
    low, high = _yarn_correction_range(rope.dims, rope.base, yarn)
    pair = torch.arange(rope.dims // 2, device=extrapolated.device, dtype=torch.float32)
    mix = (1.0 - ((pair - low) / max(0.001, high - low)).clamp(0.0, 1.0)) * yarn.ext_factor
    magnitude = rope.attn_factor * (1.0 + 0.1 * math.log(1.0 / rope.scale))
    return interpolated * (1 - mix) + extrapolated * mix, magnitude


def _yarn_correction_range(dims: int, base: float, yarn: Yarn) -> tuple[float, float]:
    """The first and last feature pair of YaRN's ramp: where a pair turns beta_fast resp. beta_slow
    times over the original context."""

    def pair_turning(turns: float) -> float:
        return dims * math.log(yarn.original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(yarn.beta_fast), pair_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(0.0, low), min(dims - 1.0, high)


def _rope(x: torch.Tensor, table: Any, dims: int, neox: bool) -> torch.Tensor:
    # x: [n, heads, head_dim]; only the first `dims` features rotate. Adjacent pairs (a, b) are the
    # complex number a + ib, turned by one complex product; halves rotate as x * cos +
    # swapped(x) * signed sin, three kernels.
    partial = dims < x.shape[-1]
    rot = x[..., :dims] if partial else x
    if neox:
        cos, sin = table
        out = torch.addcmul(rot * cos, rot.roll(dims // 2, dims=-1), sin)
    else:
        pairs = rot.float().unflatten(-1, (dims // 2, 2))
        if pairs.storage_offset() % 2:  # a complex view needs pairs aligned to their size
            pairs = pairs.contiguous()
        out = torch.view_as_real(torch.view_as_complex(pairs) * table).flatten(-2)
    return torch.cat((out, x[..., dims:].float()), dim=-1) if partial else out


def _native_rope(x: torch.Tensor, pairs: torch.Tensor, dims: int, neox: bool) -> torch.Tensor:
    """`_rope` of x [n, heads, head_dim] by a RopeRows lookup, in one native call (the same bits; native.rope_heads)."""
    return native.rope_heads(x, x.shape[1], x.shape[1], x.shape[2], pairs, dims, neox)[0]


def _rope_columns(
    y: torch.Tensor, start: int, heads: int, split: int, dim: int, pairs: torch.Tensor, dims: int, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated straight from their columns of a fused q/k/v output y: the heads' `heads`
    * `dim` columns from `start`, the first `split` heads q, the rest k (fusion.fuse_ropes)."""
    return native.rope_heads(y[:, start:] if start else y, heads, split, dim, pairs, dims, neox)


def _cached_keys(keys: Any, cells: torch.Tensor) -> torch.Tensor:
    return read_cells(keys, lambda t: t.index_select(1, cells)).transpose(0, 1).float()


def _store_keys(keys: Any, cells: torch.Tensor, new: torch.Tensor) -> Any:
    write_cells(keys, cells, new)
    return keys


# --- bound calls (graph.Plan) ---------------------------------------------------------------
# A replayed plan of few rows asks each node's binder, once, for a call that does the node's work
# with its output and native arguments made once (native.BoundCall): the same kernels on the same
# inputs, so the same bits. A binder returns None where its node would not take a native call.
# Measured: BENCHMARKS.md, "Bound calls".


def _repeating(call: Callable) -> Callable:
    """Mark a bound call that returns the same output object at every call (graph.Plan's VIEW nodes over it repeat too)."""
    call.repeats = True
    return call


def _bind_normed_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: Any, runs: Any) -> Callable | None:
    bind = getattr(weight, "bind_normed", None)
    run = bind(x, norm, eps) if bind is not None else None
    return None if run is None else _repeating(lambda x, norm, eps, weight, runs: run(x))


def _bind_added_linear(x: torch.Tensor, weight: Any, residual: torch.Tensor, runs: Any, norm: Any, eps: float) -> Callable | None:
    bind = getattr(weight, "bind_added", None)
    run = bind(x, residual, norm, eps) if bind is not None else None
    return None if run is None else _repeating(lambda x, weight, residual, runs, norm, eps: run(x, residual))


def _bind_gated_halves(y: torch.Tensor, width: int, activation: str) -> Callable | None:
    if not (y.dtype == torch.float32 and y.device.type == "cpu" and y.dim() == 2 and y.stride(1) == 1):
        return None
    out, bound = native.bind_gated_halves(y, width, activation)
    offset = 4 * width

    def call(y: torch.Tensor, width: int, activation: str) -> torch.Tensor:
        gate = y.data_ptr()
        bound(gate, gate + offset)
        return out

    return _repeating(call)


def _rope_reads(x: torch.Tensor, pairs: torch.Tensor, dims: int) -> bool:
    """Whether native.rope_heads reads x (float32, unit column stride) and the pairs as they are."""
    return (
        x.dtype is torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 and pairs.dtype is torch.float32
        and pairs.is_contiguous() and pairs.shape[0] == x.shape[0] and pairs.shape[-2] * 2 == dims
    )  # fmt: skip


def _bind_rope_columns(
    y: torch.Tensor, start: int, heads: int, split: int, dim: int, pairs: torch.Tensor, dims: int, neox: bool
) -> Callable | None:
    if y.dim() != 2 or not _rope_reads(y, pairs, dims):
        return None
    outs, bound = native.bind_rope_heads(y.shape[0], y.stride(0), heads, split, dim, dims, neox)
    offset = 4 * start

    def call(y: torch.Tensor, start: int, heads: int, split: int, dim: int, pairs: torch.Tensor, dims: int, neox: bool) -> tuple:
        bound(y.data_ptr() + offset, pairs.data_ptr())
        return outs

    return _repeating(call)


def _bind_native_rope(x: torch.Tensor, pairs: torch.Tensor, dims: int, neox: bool) -> Callable | None:
    if x.dim() != 3 or x.stride(1) != x.shape[2] or not _rope_reads(x, pairs, dims):
        return None
    (out, _), bound = native.bind_rope_heads(x.shape[0], x.stride(0), x.shape[1], x.shape[1], x.shape[2], dims, neox)

    def call(x: torch.Tensor, pairs: torch.Tensor, dims: int, neox: bool) -> torch.Tensor:
        bound(x.data_ptr(), pairs.data_ptr())
        return out

    return _repeating(call)


def _bind_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Callable | None:
    if not (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() and x.numel()):
        return None
    if weight.numel() != x.shape[-1]:
        return None
    out, bound = native.bind_rms_norm(x, weight, eps)

    def call(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        bound(x.data_ptr())
        return out

    return _repeating(call)


BINDERS: dict[Callable, Callable] = {
    _normed_linear: _bind_normed_linear,
    _added_linear: _bind_added_linear,
    _gated_halves: _bind_gated_halves,
    _rope_columns: _bind_rope_columns,
    _native_rope: _bind_native_rope,
    native.rms_norm: _bind_rms_norm,
    attention: bind_attention,  # not `repeats`: a step it does not take returns attention's own output
    **{fn: VIEW for fn in (torch.reshape, operator.getitem, *VIEW_FUNCTIONS)},
}
