"""Rewrites of a freshly recorded graph (the model code stays as written).

Linears that read the same input run as one matmul (q/k/v, gate/up): linears of one input node
with compatible weights become one node over their weights stacked by rows, and each original
node becomes a column slice of its output. Fewer, larger kernel calls: for smollm2 decode, 4
int4 calls a layer instead of 7. The stacked weight is built once, and the originals are pointed
into its storage, so nothing is held twice. Also: q and k rotate in one rope call, and a gated
activation (act(gate) * up) is one node.
"""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable

import attrs
import torch

from corral.plugins.backends.torch.graph import Graph, Node, Rewrite
from corral.plugins.backends.torch.layouts import Int4Blocks, Int4Weight, Int8Weight, MappedRows

# The CPU int4 layout packs blocks of 64 rows (32 below AVX-512) independently: row-stacking packed
# weights equals packing the stacked codes only when every part is whole blocks.
INT4_STACK_ROWS = 64


@attrs.frozen
class StackedRows:
    """Several weights' exact rows, one after the other (the prompt-chunk path of a stacked weight)."""

    parts: tuple[MappedRows, ...]

    def dequantized(self) -> torch.Tensor:
        return torch.cat([part.dequantized() for part in self.parts])


def stack_weights(weights: list[Any]) -> Any | None:
    """One weight computing all of `weights`' outputs side by side, or None when they cannot be stacked."""
    kinds = {type(w) for w in weights}
    if kinds not in ({Int4Weight}, {Int4Blocks}, {Int8Weight}) or len({w.in_features for w in weights}) != 1:
        return None
    if kinds == {Int4Blocks}:
        if len({w.scales.dtype for w in weights}) != 1:
            return None
        parts = [w.codes for w in weights], [w.scales for w in weights], [w.mins for w in weights]
        stacked = Int4Blocks(*(torch.cat(p) for p in parts))
        for part, whole in zip(parts, (stacked.codes, stacked.scales, stacked.mins)):
            _share_rows(part, whole)
        return stacked
    if kinds == {Int4Weight}:
        sources = [w.source for w in weights]
        source = StackedRows(tuple(sources)) if all(sources) else None
        if any(w.packed.device.type != "cpu" or w.out_features % INT4_STACK_ROWS for w in weights):
            return None
        stacked = Int4Weight(
            torch.cat([w.packed for w in weights]),
            torch.cat([w.scales_and_zeros for w in weights], dim=1),
            sum(w.out_features for w in weights),
            weights[0].in_features,
            source,
        )
        _share_rows([w.packed for w in weights], stacked.packed)
        return stacked
    if kinds == {Int8Weight}:
        stacked = Int8Weight(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]))
        _share_rows([w.codes for w in weights], stacked.codes)
        _share_rows([w.scales for w in weights], stacked.scales)
        return stacked
    return None


def _share_rows(parts: list[torch.Tensor], stacked: torch.Tensor) -> None:
    # Each original becomes a view of its rows of the stacked copy, freeing its own storage.
    start = 0
    for part in parts:
        rows = stacked[start : start + part.shape[0]]
        part.set_(rows.untyped_storage(), rows.storage_offset(), rows.shape, rows.stride())
        start += part.shape[0]


def fuse_linears(graph: Graph, outputs: tuple[Node, ...], linear: Callable, stacked_for: Callable) -> tuple[Node, ...]:
    """Rewrite `graph` so linears sharing an input run once; returns `outputs` renumbered."""
    groups: dict[int, list[int]] = {}
    for i, (fn, args) in enumerate(graph.nodes):
        if fn is linear and type(args[0]) is Node and args[2] is None:
            groups.setdefault(args[0].index, []).append(i)
    starts: dict[int, tuple[Any, list[int]]] = {}  # first member -> stacked weight, column widths
    slices: dict[int, tuple[int, int]] = {}  # member -> (first member, its part)
    for members in groups.values():
        weights = [graph.nodes[i][1][1] for i in members]
        stacked = stacked_for(weights) if len(members) > 1 else None
        if stacked is None:
            continue
        starts[members[0]] = (stacked, [weight.out_features for weight in weights])
        for part, i in enumerate(members):
            slices[i] = (members[0], part)
    if not starts:
        return outputs
    rewrite = Rewrite(graph)
    parts_at: dict[int, Node] = {}  # first member -> the node splitting the fused output
    for i, (fn, args) in enumerate(graph.nodes):
        if i in starts:
            x, _, _, runs = args
            stacked, widths = starts[i]
            fused = rewrite.add(linear, rewrite.new(x), stacked, None, runs)
            parts_at[i] = rewrite.add(_split_columns, fused, widths)
        if i in slices:
            first, part = slices[i]
            rewrite.replace(i, operator.getitem, parts_at[first], part)  # a view: no kernel
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def _reader_counts(nodes: list[tuple[Callable, tuple]]) -> dict[int, int]:
    """How many argument places read each node's value."""
    readers: dict[int, int] = {}
    for _, args in nodes:
        for a in args:
            if type(a) is Node:
                readers[a.index] = readers.get(a.index, 0) + 1
    return readers


def _split_columns(y: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, ...]:
    return y.split_with_sizes(widths, dim=-1)  # one call for all parts (Tensor.split adds Python)


def fuse_ropes(graph: Graph, outputs: tuple[Node, ...], rope: Callable, joint: Callable | None = None) -> tuple[Node, ...]:
    """Rewrite `graph` so that q and k, adjacent column parts of one fused linear reshaped into
    heads of one size and rotated by the same table, rotate in one call over both parts' heads
    (llama: one rope a layer instead of two; the rotation of each head is unchanged).
    `joint(fused, start, heads, q_heads, dim, table, dims, neox) -> (q, k)`, where given, reads the
    heads from the fused output's columns itself: one node instead of a view, the rope and two slices."""
    nodes = graph.nodes
    pairs = _rope_pairs(nodes, rope)
    if not pairs:
        return outputs
    readers = _reader_counts(nodes)
    joint_at: dict[int, tuple] = {}  # first rope -> (joint heads node args, rope args)
    part_of: dict[int, tuple[int, int, int]] = {}  # rope -> (first rope, first head, end head)
    dropped: set[int] = set()
    for (qi, ki), (fused, start, stop, q_heads, k_heads, dim) in pairs.items():
        table, dims, neox = nodes[qi][1][1:]
        joint_at[qi] = ((fused, start, stop, q_heads + k_heads, dim), (table, dims, neox))
        part_of[qi], part_of[ki] = (qi, 0, q_heads), (qi, q_heads, q_heads + k_heads)
        for rope_node in (qi, ki):  # the reshape and part read only by this rope are no longer needed
            reshaped = nodes[rope_node][1][0].index
            part = nodes[reshaped][1][0].index
            if readers[reshaped] == 1:
                dropped.add(reshaped)
                if readers[part] == 1:
                    dropped.add(part)
    rewrite, rotated_at = Rewrite(graph), {}
    for i in range(len(nodes)):
        if i in dropped:
            continue
        if i in joint_at:
            (fused, start, stop, heads, dim), (table, dims, neox) = joint_at[i]
            if joint is not None:
                q_heads = part_of[i][2]
                rotated_at[i] = rewrite.add(joint, rewrite.new(fused), start, heads, q_heads, dim, rewrite.new(table), dims, neox)
            else:
                both = rewrite.add(_column_heads, rewrite.new(fused), start, stop, heads, dim)
                rotated_at[i] = rewrite.add(rope, both, rewrite.new(table), dims, neox)
        if i in part_of:
            first, head, end = part_of[i]
            if joint is not None:
                rewrite.replace(i, operator.getitem, rotated_at[first], 0 if head == 0 else 1)  # a tuple's item: no kernel
            else:
                rewrite.replace(i, _heads, rotated_at[first], head, end)
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def _rope_pairs(nodes: list[tuple[Callable, tuple]], rope: Callable) -> dict[tuple[int, int], tuple]:
    """(q rope, k rope) -> (fused output, first column, end column, q heads, k heads, head size) for
    each pair of ropes the pass can join: reshapes of adjacent parts of one split, one table."""
    parts: dict[tuple, tuple[int, int, int]] = {}  # (split, part, table, dims, neox) -> (rope, heads, head size)
    for i, (fn, args) in enumerate(nodes):
        if fn is not rope or type(args[0]) is not Node or type(args[1]) is not Node:
            continue
        reshape_fn, reshape_args = nodes[args[0].index]
        if reshape_fn is not torch.reshape or type(reshape_args[0]) is not Node or len(reshape_args[1]) != 3:
            continue
        get_fn, get_args = nodes[reshape_args[0].index]
        if get_fn is not operator.getitem or nodes[get_args[0].index][0] is not _split_columns:
            continue
        _, heads, dim = reshape_args[1]
        table, dims, neox = args[1:]
        parts[(get_args[0].index, get_args[1], table.index, dims, neox)] = (i, heads, dim)
    pairs, paired = {}, set()
    for (split, part, table, dims, neox), (qi, q_heads, dim) in parts.items():
        k = parts.get((split, part + 1, table, dims, neox))
        if k is None or k[2] != dim or k[0] < qi or {qi, k[0]} & paired:
            continue
        fused, widths = nodes[split][1]
        if widths[part] != q_heads * dim or widths[part + 1] != k[1] * dim:
            continue
        start = sum(widths[:part])
        pairs[(qi, k[0])] = (fused, start, start + widths[part] + widths[part + 1], q_heads, k[1], dim)
        paired |= {qi, k[0]}
    return pairs


def _column_heads(y: torch.Tensor, start: int, stop: int, heads: int, dim: int) -> torch.Tensor:
    return y[:, start:stop].reshape(-1, heads, dim)


def _heads(x: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return x[:, first:end]


def fuse_gates(graph: Graph, outputs: tuple[Node, ...], activations: dict[Callable, str], gated: Callable) -> tuple[Node, ...]:
    """Rewrite `graph` so that mul(act(gate), up), act one of `activations` and read only by the
    product, is one node gated(gate, up, name): one pass over the fused gate/up output."""
    nodes = graph.nodes
    readers = _reader_counts(nodes)
    gates: dict[int, tuple[int, Node, Node, str]] = {}  # mul -> (activation node, gate, up, name)
    for i, (fn, args) in enumerate(nodes):
        if fn is not torch.mul or len(args) != 2 or not all(type(a) is Node for a in args):
            continue
        for act, up in (args, args[::-1]):
            act_fn, act_args = nodes[act.index]
            if act_fn in activations and readers[act.index] == 1 and len(act_args) == 1 and type(act_args[0]) is Node:
                gates[i] = (act.index, act_args[0], up, activations[act_fn])
                break
    if not gates:
        return outputs
    dropped = {act for act, _, _, _ in gates.values()}
    rewrite = Rewrite(graph)
    for i in range(len(nodes)):
        if i in dropped:
            continue
        if i in gates:
            _, gate, up, name = gates[i]
            rewrite.replace(i, gated, rewrite.new(gate), rewrite.new(up), name)
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def _split_parts(nodes: list[tuple[Callable, tuple]], readers: dict[int, int]) -> dict[int, tuple[int, int, int]]:
    """getitem nodes of a `_split_columns` that only getitems read: getitem -> (split, first column, end column)."""
    parts = {}
    for i, (fn, args) in enumerate(nodes):
        if fn is not operator.getitem or type(args[0]) is not Node or nodes[args[0].index][0] is not _split_columns:
            continue
        split = args[0].index
        widths = nodes[split][1][1]
        parts[i] = (split, sum(widths[: args[1]]), sum(widths[: args[1] + 1]))
    getitems = collections.Counter(split for split, _, _ in parts.values())
    return {i: part for i, part in parts.items() if getitems[part[0]] == readers[part[0]]}


def fuse_gated_halves(graph: Graph, outputs: tuple[Node, ...], gated: Callable, halves: Callable) -> tuple[Node, ...]:
    """Rewrite `graph` so that gated(gate, up, name) over the two halves of a fused gate/up output,
    read by nothing else, is halves(fused, width, name): the halves are read in place, not cut out
    as tensor views first."""
    nodes = graph.nodes
    readers = _reader_counts(nodes)
    parts = _split_parts(nodes, readers)
    fused: dict[int, tuple[int, int]] = {}  # gated node -> (split, width)
    for i, (fn, args) in enumerate(nodes):
        if fn is not gated or not all(type(a) is Node and a.index in parts and readers[a.index] == 1 for a in args[:2]):
            continue
        (split, gate_start, width), (up_split, up_start, up_end) = parts[args[0].index], parts[args[1].index]
        if split == up_split and gate_start == 0 and up_start == width and up_end == 2 * width and readers[split] == 2:
            fused[i] = (split, width)
    if not fused:
        return outputs
    dropped = {split for split, _ in fused.values()} | {a.index for i in fused for a in nodes[i][1][:2]}
    rewrite = Rewrite(graph)
    for i, (fn, args) in enumerate(nodes):
        if i in dropped:
            continue
        if i in fused:
            split, width = fused[i]
            rewrite.replace(i, halves, rewrite.new(nodes[split][1][0]), width, args[2])
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def slice_lone_parts(graph: Graph, outputs: tuple[Node, ...]) -> tuple[Node, ...]:
    """Rewrite `graph` so that a fused output's split read for one part only (v, once q and k rotate
    straight from their columns) is a column slice: one view instead of a split into all parts."""
    nodes = graph.nodes
    readers = _reader_counts(nodes)
    lone = {i: part for i, part in _split_parts(nodes, readers).items() if readers[part[0]] == 1}
    if not lone:
        return outputs
    dropped = {split for split, _, _ in lone.values()}
    rewrite = Rewrite(graph)
    for i in range(len(nodes)):
        if i in dropped:
            continue
        if i in lone:
            split, start, end = lone[i]
            rewrite.replace(i, _columns, rewrite.new(nodes[split][1][0]), start, end)
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def _columns(y: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return y[..., start:end]


# The rewrites' nodes that only view their input (graph.Plan binds them as VIEW).
VIEW_FUNCTIONS = (_split_columns, _columns)


def fuse_norms(graph: Graph, outputs: tuple[Node, ...], norm: Callable, linear: Callable, normed: Callable) -> tuple[Node, ...]:
    """Rewrite `graph` so that linear(norm(x, w, eps), weight, None, runs), the norm read by nothing
    else and the weight one with a `normed_matmul`, is normed(x, w, eps, weight, runs): one kernel
    call that norms the rows itself (llama's attention and feed-forward inputs)."""
    nodes = graph.nodes
    readers = _reader_counts(nodes)
    fused: dict[int, int] = {}  # linear -> its norm
    for i, (fn, args) in enumerate(nodes):
        if fn is not linear or type(args[0]) is not Node or args[2] is not None or not hasattr(args[1], "normed_matmul"):
            continue
        source = args[0].index
        if nodes[source][0] is norm and readers[source] == 1:
            fused[i] = source
    if not fused:
        return outputs
    dropped = set(fused.values())
    rewrite = Rewrite(graph)
    for i, (fn, args) in enumerate(nodes):
        if i in dropped:
            continue
        if i in fused:
            x, weight, eps = nodes[fused[i]][1]
            rewrite.replace(i, normed, rewrite.new(x), weight, eps, args[1], args[3])
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)


def fuse_residuals(graph: Graph, outputs: tuple[Node, ...], linear: Callable, norm: Callable | None, added: Callable) -> tuple[Node, ...]:
    """Rewrite `graph` so that add(residual, linear(x, weight, None, runs)), the linear read by
    nothing else and its weight one with an `added_matmul`, is added(x, weight, residual, runs, None,
    0.0): the sum made in the kernel's call (llama's attention and feed-forward outputs). With `norm`,
    add(residual, norm(linear(...), w, eps)) too, the norm read only by the sum, is added(x, weight,
    residual, runs, w, eps) (Gemma's post-norms)."""
    nodes = graph.nodes
    readers = _reader_counts(nodes)
    fused: dict[int, tuple[int, Node, int | None]] = {}  # add -> (its linear, the residual, the norm between)

    def product_of(node: Node) -> tuple[int, int | None] | None:
        between = None
        fn, args = nodes[node.index]
        if norm is not None and fn is norm and type(args[0]) is Node and readers[node.index] == 1:
            between, node = node.index, args[0]
            fn, args = nodes[node.index]
        if fn is linear and args[2] is None and hasattr(args[1], "added_matmul") and readers[node.index] == 1:
            return node.index, between
        return None

    for i, (fn, args) in enumerate(nodes):
        if fn is not torch.add or len(args) != 2 or not all(type(a) is Node for a in args):
            continue
        for product, residual in (args, args[::-1]):
            found = product_of(product)
            if found is not None:
                fused[i] = (found[0], residual, found[1])
                break
    if not fused:
        return outputs
    dropped = {product for product, _, _ in fused.values()} | {between for _, _, between in fused.values() if between is not None}
    rewrite = Rewrite(graph)
    for i in range(len(nodes)):
        if i in dropped:
            continue
        if i in fused:
            product, residual, between = fused[i]
            x, weight, _, runs = nodes[product][1]
            weights, eps = (None, 0.0) if between is None else nodes[between][1][1:]
            rewrite.replace(i, added, rewrite.new(x), weight, rewrite.new(residual), runs, weights, eps)
        else:
            rewrite.keep(i)
    return rewrite.finish(outputs)
