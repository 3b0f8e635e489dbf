"""Recorded graphs of the torch backend, and their reuse from one step to the next.

A model's `forward` records a list of (function, arguments) nodes. What changes from step to step
(the batch's arrays, its per-sequence row runs, the cache view) enters the graph only as `Slot`
arguments bound when the graph runs, so the graph of a decode step can run again for the next
step with new bindings instead of being rebuilt by the model (which costs as much Python as
running it). A graph whose inputs are not the batch's own arrays is used once.

A graph's first run interprets its node list; from its second run on, it runs as a generated
straight-line Python function (`Plan`): one call per node with its arguments in local variables,
each value dropped after its last reader: less Python a node than interpreting the list, which
counts at a decode step's hundreds of nodes (measured: BENCHMARKS.md, Measurements behind code decisions).
A backend may also give a graph binders (Plan): its second run then puts bound calls, which keep
their outputs and prepared arguments from run to run, in place of the nodes that take them.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np
import torch

BATCH_FIELDS = ("inputs", "positions", "sequences", "outputs")
# Distinct batch shapes kept: decode shapes (1..parallel rows) and the fixed prompt chunks.
GRAPHS_KEPT = 32


class Node:
    """A recorded op's output; supports `+ - * /` (with nodes or numbers) for readable model code."""

    __slots__ = ("graph", "index")

    def __init__(self, graph: Graph, index: int):
        self.graph, self.index = graph, index

    def __add__(self, other: Node | float) -> Node:
        return self.graph.record(torch.add, self, other)

    def __sub__(self, other: Node | float) -> Node:
        return self.graph.record(torch.sub, self, other)

    def __mul__(self, other: Node | float) -> Node:
        return self.graph.record(torch.mul, self, other)

    def __truediv__(self, other: Node | float) -> Node:
        return self.graph.record(torch.div, self, other)


class Slot:
    """An argument bound anew each time the graph runs: a batch array, the row runs or the cache view."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Graph:
    """Nodes in recording order; `compute()` runs them eagerly under inference mode.

    `binders`: node function -> its binder (a backend's; see Plan), none by default."""

    binders: dict[Callable, Callable] = {}

    def __init__(self, batch: Any = None, view: Any = None):
        self.nodes: list[tuple[Callable, tuple]] = []
        self.bindings: dict[str, Any] = {}
        self.replayable = batch is not None
        self._plan: Plan | None = None
        self.batch, self.view = batch, view
        if batch is not None:
            self.bind(batch, view)

    def record(self, fn: Callable, *args: Any) -> Node:
        self.nodes.append((fn, args))
        return Node(self, len(self.nodes) - 1)

    def bind(self, batch: Any, view: Any) -> None:
        """Point the graph's slots at another batch of the same shape."""
        self.bindings = {name: getattr(batch, name) for name in BATCH_FIELDS}
        self.bindings["runs"] = row_runs(batch.sequences, view)
        self.bindings["view"] = view
        self.batch, self.view = batch, view

    def batch_slot(self, values: np.ndarray) -> Slot | None:
        """The slot of `values` when it is one of the batch's arrays; None (and no reuse) otherwise."""
        for name in BATCH_FIELDS:
            if self.batch is not None and values is getattr(self.batch, name):
                return Slot(name)
        self.replayable = False
        return None

    def optimize(self, output: Node) -> Node:
        """Rewrite the recorded graph before it first runs (a backend's fusions); returns `output` renumbered."""
        return output

    def compute(self, *outputs: Node) -> list[torch.Tensor]:
        key = tuple(out.index for out in outputs)
        if self._plan is None or not self._plan.fits(self.nodes, key):
            self._plan = Plan(self.nodes, key, self.binders)
        with torch.inference_mode():
            return self._plan.run(self.bindings)


class Plan:
    """How to run a node list for some outputs: which values each node is the last reader of, and,
    once the same plan runs a second time, the node list compiled into one Python function.

    With `binders` (node function -> binder), that second run also binds: each node whose function
    has a binder is offered its arguments of this run, and the call the binder returns (None: the
    node stays as it is) takes the node's place from then on. A bound call computes what its
    function does, into an output it reuses at every run, so none may reach the plan's outputs:
    a node whose output does is given back its function."""

    def __init__(self, nodes: list[tuple[Callable, tuple]], outputs: tuple[int, ...], binders: dict[Callable, Callable] | None = None):
        self.nodes, self.size, self.outputs = nodes, len(nodes), outputs
        self.releases = _releases(nodes, outputs)
        self.binders = binders or {}
        self._bound_nodes = nodes  # the node list it compiles: with the bound calls in place, once bound
        self.runs = 0
        self._compiled: Callable | None = None

    def fits(self, nodes: list[tuple[Callable, tuple]], outputs: tuple[int, ...]) -> bool:
        # The node list itself (rewrites install a new one) and its length (recording appends).
        return nodes is self.nodes and len(nodes) == self.size and outputs == self.outputs

    def run(self, bound: dict[str, Any]) -> list[Any]:
        self.runs += 1
        if self._compiled is None and self.runs > 1:
            nodes, results = self._bind(bound) if self.binders else (self.nodes, None)
            self._bound_nodes = nodes
            self._compiled = _compile(nodes, self.outputs, self.releases)
            if results is not None:
                return results
        if self._compiled is not None:
            return self._compiled(bound)
        values: list[Any] = [None] * len(self.nodes)
        for i, (fn, args) in enumerate(self.nodes):
            values[i] = fn(*[values[a.index] if type(a) is Node else bound[a.name] if type(a) is Slot else a for a in args])
            for done in self.releases[i]:
                values[done] = None  # its last reader has run: free it now, not at the end of the graph
        return [values[out] for out in self.outputs]


    def _bind(self, bound: dict[str, Any]) -> tuple[list[tuple[Callable, tuple]], list[Any]]:
        """Run the nodes, binding those whose binder returns a call; the node list with the bound
        calls in place, and this run's outputs.

        A bound call marked `repeats` returns the same object at every run; a node whose binder is
        VIEW (a view of its arguments) whose node arguments all repeat then repeats too, and is
        computed this once."""
        nodes = list(self.nodes)
        values: list[Any] = [None] * len(nodes)
        owners: dict[int, list[int]] = collections.defaultdict(list)  # a bound call's output storage -> nodes giving it
        repeats: set[int] = set()
        for i, (fn, args) in enumerate(self.nodes):
            resolved = [values[a.index] if type(a) is Node else bound[a.name] if type(a) is Slot else a for a in args]
            binder = self.binders.get(fn) if _hashable(fn) and i not in self.outputs else None
            if binder is VIEW:
                values[i] = fn(*resolved)
                sources = [a.index for a in args if type(a) is Node]
                repeated = sources and all(j in repeats for j in sources) and not any(type(a) is Slot for a in args)
                # a view indeed: nothing of its own (reshape copies what it cannot view; an index tensor gathers)
                if repeated and set(_storages(values[i])) <= {address for j in sources for address in _storages(values[j])}:
                    nodes[i] = (_Repeated(values[i]), ())
                    repeats.add(i)
                    for address in _storages(values[i]):
                        owners[address].append(i)
                continue
            call = binder(*resolved) if binder is not None else None
            if call is not None:
                nodes[i] = (call, args)
            values[i] = (call or fn)(*resolved)
            if call is not None:
                for address in _storages(values[i]):
                    owners[address].append(i)
                if getattr(call, "repeats", False):
                    repeats.add(i)
        for out in self.outputs:  # an output must be the run's own, never a buffer the next run overwrites
            for address in _storages(values[out]):
                for j in owners.get(address, ()):
                    nodes[j] = self.nodes[j]
        return nodes, [values[out] for out in self.outputs]


VIEW = object()  # Plan binders' mark of a function whose value is a view of its arguments


class _Repeated:
    """A node's value computed once (Plan._bind): the same object at every run."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _hashable(fn: Any) -> bool:
    try:
        hash(fn)
    except TypeError:
        return False
    return True


def _storages(value: Any) -> list[int]:
    """The storage addresses of the tensors in value (a tensor, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, (tuple, list)):
        return [address for item in value for address in _storages(item)]
    return []


def _releases(nodes: list[tuple[Callable, tuple]], outputs: tuple[int, ...]) -> list[list[int]]:
    """For each node, the values whose last reader it is (outputs are never released)."""
    last_reader = {}
    for i, (_, args) in enumerate(nodes):
        for a in args:
            if type(a) is Node:
                last_reader[a.index] = i
    releases: list[list[int]] = [[] for _ in nodes]
    for value, reader in last_reader.items():
        if value not in outputs:
            releases[reader].append(value)
    return releases


def _compile(nodes: list[tuple[Callable, tuple]], outputs: tuple[int, ...], releases: list[list[int]]) -> Callable:
    """The node list as `run(bound) -> [outputs]`: functions and constant arguments are closure
    variables, slots are read from `bound` once, values are locals deleted after their last reader."""
    free: list[Any] = []  # closure values, named c0, c1, ...
    slots: set[str] = set()
    lines = []

    def constant(value: Any) -> str:
        free.append(value)
        return f"c{len(free) - 1}"

    def argument(a: Any) -> str:
        if type(a) is Node:
            return f"v{a.index}"
        if type(a) is Slot:
            slots.add(a.name)
            return f"s_{a.name}"
        return constant(a)

    for i, (fn, args) in enumerate(nodes):
        call = f"{constant(fn)}({', '.join(argument(a) for a in args)})"
        lines.append(f"v{i} = {call}")
        if releases[i]:
            lines.append("del " + ", ".join(f"v{done}" for done in releases[i]))
    lines.append(f"return [{', '.join(f'v{out}' for out in outputs)}]")
    body = [f"s_{name} = bound[{name!r}]" for name in sorted(slots)] + lines
    source = f"def make({', '.join(f'c{j}' for j in range(len(free)))}):\n    def run(bound):\n"
    source += "".join(f"        {line}\n" for line in body) + "    return run\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<corral graph>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace["make"](*free)


class Rewrite:
    """A graph's node list rebuilt in order by a rewriting pass: new nodes inserted, old ones kept,
    replaced or dropped, and every kept node's arguments pointed at their new positions."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[tuple[Callable, tuple]] = []
        self._moved: dict[int, int] = {}

    def new(self, old: Node) -> Node:
        """Where an old node, already visited, now is."""
        return Node(self.graph, self._moved[old.index])

    def add(self, fn: Callable, *args: Any) -> Node:
        """A new node; its Node arguments are new ones."""
        self.nodes.append((fn, args))
        return Node(self.graph, len(self.nodes) - 1)

    def replace(self, old: int, fn: Callable, *args: Any) -> Node:
        """A new node that stands for old node `old` from now on."""
        node = self.add(fn, *args)
        self._moved[old] = node.index
        return node

    def keep(self, old: int) -> None:
        """Old node `old` as it was, its arguments moved."""
        fn, args = self.graph.nodes[old]
        self.replace(old, fn, *(self.new(a) if type(a) is Node else a for a in args))

    def finish(self, outputs: tuple[Node, ...]) -> tuple[Node, ...]:
        """Install the new node list; returns `outputs` where they now are."""
        self.graph.nodes = self.nodes
        return tuple(self.new(out) for out in outputs)


class WholeSequence:
    """The row runs of an encoder pass: one sequence and no cache view (an image's patches, a text to embed).
    Every row any tensor of its graph holds is that sequence's, however many rows the graph kept (LLaVA
    drops its class row before the projector; a patch merger pools rows), so each linear is one product
    over all its rows. With other sequences or a cache, rows the runs do not cover (selected outputs) are
    lone rows, which is what keeps a decoder's sequences batch-invariant."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WHOLE_SEQUENCE"


WHOLE_SEQUENCE = WholeSequence()


def row_runs(sequences: np.ndarray, view: Any) -> list[tuple[int, int]] | WholeSequence:
    """The runs a graph's linears take: the batch's per-sequence runs, or WHOLE_SEQUENCE for an encoder pass."""
    runs = sequence_runs(sequences)
    return WHOLE_SEQUENCE if view is None and len(runs) == 1 else runs


def sequence_runs(sequences: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) row ranges of consecutive rows of one sequence."""
    if len(sequences) == 0:
        return []
    cuts = (np.flatnonzero(sequences[1:] != sequences[:-1]) + 1).tolist()
    bounds = [0, *cuts, len(sequences)]
    return list(zip(bounds[:-1], bounds[1:]))


class GraphCache:
    """Recorded graphs by batch shape, least recently used dropped first."""

    def __init__(self, size: int = GRAPHS_KEPT):
        self.size = size
        self._graphs: collections.OrderedDict[tuple, tuple[Any, Graph, Node]] = collections.OrderedDict()

    def run(self, model: Any, batch: Any, view: Any, new_graph: Callable[[Any, Any], Graph]) -> torch.Tensor:
        """The model's logits for `batch`, from a reused graph when one of this shape was recorded."""
        key = (len(batch.inputs), len(batch.outputs))
        # A batch carrying image embeddings has ops a text batch of its shape lacks: never a reused graph.
        entry = self._graphs.get(key) if getattr(batch, "embeddings", None) is None else None
        if entry is not None and entry[0] is model:
            self._graphs.move_to_end(key)
            _, graph, out = entry
            graph.bind(batch, view)
            return graph.compute(out)[0]
        graph = new_graph(batch, view)
        out = graph.optimize(model.forward(graph, batch, view))
        if graph.replayable:
            self._graphs[key] = (model, graph, out)
            while len(self._graphs) > self.size:
                self._graphs.popitem(last=False)
        return graph.compute(out)[0]
