"""Bound calls (graph.Plan's binders, context.BINDERS): a replayed plan's native nodes with their
outputs and arguments made once must compute what the unbound nodes compute, bit for bit, and
never hand out a buffer that a later run overwrites."""

from __future__ import annotations

import collections
import operator

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import VOCAB_SIZE, write_tiny_gemma3, write_tiny_llama

from corral.gguf import GGUFFile
from corral.kvcache import CausalCache
from corral.model import Batch
from corral.plugins.backends.torch import TorchBackend
from corral.plugins.backends.torch import context as torch_context, native as torch_native
from corral.plugins.backends.torch.graph import VIEW, Node, Plan, Slot
from corral.plugins.backends.torch.layouts import Int4Blocks
from corral.registry import Plugins

Q = gguf.GGMLQuantizationType
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TOKENS = [int(t) for t in np.random.default_rng(11).integers(0, VOCAB_SIZE, 16)]

needs_native = pytest.mark.skipif(
    not all(torch_native.has(name) for name in ("int4_blocks_added", "int8_rows_added", "row_attention", "rope_heads", "gated")),
    reason="the native kernels are not built here",
)


# --- the plan's binding, with a binder of the test's own ----------------------------------------


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def bind_double(x: torch.Tensor):
    out = torch.empty_like(x)
    return lambda x: torch.mul(x, 2, out=out)


def bind_double_repeating(x: torch.Tensor):
    out = torch.empty_like(x)

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, 2, out=out)

    call.repeats = True
    return call


def plan_of(*nodes: tuple, outputs: tuple[int, ...], repeating: bool = False) -> Plan:
    binders = {double: bind_double_repeating if repeating else bind_double, torch.reshape: VIEW, operator.getitem: VIEW}
    return Plan(list(nodes), outputs, binders)


def test_a_plan_binds_from_its_second_run_and_gives_the_same_values():
    plan = plan_of((double, (Slot("x"),)), (double, (Node(None, 0),)), (torch.add, (Node(None, 1), 1.0)), outputs=(2,))
    results = [plan.run({"x": torch.full((3,), float(i))})[0] for i in range(4)]
    for i, got in enumerate(results):  # each run's output is its own: none was overwritten by a later run
        assert torch.equal(got, torch.full((3,), 4.0 * i + 1))
    bound = [fn for fn, _ in plan._bound_nodes]
    assert bound[0] is not double and bound[1] is not double and bound[2] is torch.add


def test_a_plan_never_binds_an_output_nor_a_node_whose_output_reaches_one():
    # node 1 is an output; node 0's output reaches output 2 through a view
    plan = plan_of((double, (Slot("x"),)), (double, (Node(None, 0),)), (torch.reshape, (Node(None, 0), (3, 1))), outputs=(1, 2))
    results = [plan.run({"x": torch.full((3,), float(i))}) for i in range(4)]
    for i, (doubled_twice, viewed) in enumerate(results):
        assert torch.equal(doubled_twice, torch.full((3,), 4.0 * i))
        assert torch.equal(viewed, torch.full((3, 1), 2.0 * i))
    assert [fn for fn, _ in plan._bound_nodes] == [double, double, torch.reshape]


def test_views_of_a_repeating_bound_output_are_made_once_and_follow_its_values():
    x = Node(None, 0)
    plan = plan_of(
        (double, (Slot("x"),)),
        (torch.reshape, (x, (2, 2))),  # a view: made once
        (operator.getitem, (Node(None, 1), 1)),  # a view of a view: made once
        (operator.getitem, (x, torch.tensor([3, 0]))),  # gathers: a copy of its own, made at every run
        (torch.add, (Node(None, 2), 0.0)),
        (torch.add, (Node(None, 3), 0.0)),
        outputs=(4, 5),
        repeating=True,
    )
    for i in range(4):
        row, gathered = plan.run({"x": torch.arange(4.0) + i})
        assert torch.equal(row, 2 * (torch.arange(2.0, 4.0) + i)) and torch.equal(gathered, 2 * (torch.tensor([3.0, 0.0]) + i))
    kinds = [type(fn).__name__ for fn, _ in plan._bound_nodes]
    assert kinds[1] == kinds[2] == "_Repeated" and plan._bound_nodes[3][0] is operator.getitem


def test_a_view_reaching_an_output_gives_its_bound_source_back_its_function():
    plan = plan_of((double, (Slot("x"),)), (torch.reshape, (Node(None, 0), (2, 2))), (operator.getitem, (Node(None, 1), 0)), outputs=(2,), repeating=True)
    results = [plan.run({"x": torch.arange(4.0) + i})[0] for i in range(4)]
    for i, got in enumerate(results):
        assert torch.equal(got, 2 * (torch.arange(2.0) + i))
    assert [fn for fn, _ in plan._bound_nodes][:2] == [double, torch.reshape]


def test_a_binder_that_declines_leaves_its_node_as_it_is():
    plan = Plan([(double, (Slot("x"),)), (torch.neg, (Node(None, 0),))], (1,), {double: lambda x: None})
    for i in range(3):
        assert torch.equal(plan.run({"x": torch.ones(2) * i})[0], -2.0 * i * torch.ones(2))
    assert plan._bound_nodes[0][0] is double


# --- real plans of tiny models --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    """A llama whose linears are all Q4_0 (int4 blocks) and a gemma3 whose linears are all Q8_0 (int8 rows)."""
    folder = tmp_path_factory.mktemp("bound")
    types = {qtype: {f"blk.{b}.{name}.weight": qtype for b in range(6) for name in LINEARS} for qtype in (Q.Q4_0, Q.Q8_0)}
    return {
        "llama": write_tiny_llama(folder / "llama.gguf", tensor_types=types[Q.Q4_0]),
        "gemma3": write_tiny_gemma3(folder / "gemma3.gguf", tensor_types=types[Q.Q8_0]),
    }


def load(path: str, architecture: str):
    backend = TorchBackend(device="cpu", precision="auto")
    return backend, Plugins().architectures()[architecture].from_gguf(GGUFFile.open(path), backend)


def decode(path: str, architecture: str, bound: bool, monkeypatch, sequences: int = 1) -> tuple[list[torch.Tensor], TorchBackend]:
    """A 5-token prompt per sequence, then decode steps taking turns between the sequences (each
    its own cache): the logits of every step, through graphs reused by shape."""
    with monkeypatch.context() as patch:
        if not bound:
            patch.setattr(torch_context, "BOUND_ROWS", 0)
        backend, model = load(path, architecture)
        caches = [CausalCache(backend, model.cache_layers(), 32) for _ in range(sequences)]
        logits = []
        for s, cache in enumerate(caches):
            logits.append(backend.run(model, Batch.single(TOKENS[s : s + 5]), cache.prepare(Batch.single(TOKENS[s : s + 5]))))
        for step in range(8):
            for s, cache in enumerate(caches):
                batch = Batch.single([TOKENS[(3 * step + s) % len(TOKENS)]], start=5 + step)
                logits.append(backend.run(model, batch, cache.prepare(batch)))  # never copied: no run may overwrite another's
    return logits, backend


def bound_kinds(backend: TorchBackend) -> collections.Counter:
    """The decode plan's bound calls, by the function they stand for."""
    (_, graph, _) = backend._graphs._graphs[(1, 1)]
    plan = graph._plan
    return collections.Counter(original.__name__ for (original, _), (fn, _) in zip(plan.nodes, plan._bound_nodes) if fn is not original)


@needs_native
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
@pytest.mark.parametrize("sequences", [1, 2])
def test_bound_decode_steps_give_the_bits_of_unbound_ones(tiny_paths, monkeypatch, architecture, sequences):
    got, backend = decode(tiny_paths[architecture], architecture, True, monkeypatch, sequences)
    expected, _ = decode(tiny_paths[architecture], architecture, False, monkeypatch, sequences)
    assert len(got) == len(expected) == sequences * 9
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    kinds = bound_kinds(backend)
    assert {"_normed_linear", "_added_linear", "attention", "_gated_halves"} <= set(kinds)
    assert "_rope_columns" in kinds or "_native_rope" in kinds


@needs_native
def test_an_unbound_plan_has_no_bound_calls(tiny_paths, monkeypatch):
    _, backend = decode(tiny_paths["llama"], "llama", False, monkeypatch)
    (_, graph, _) = backend._graphs._graphs[(1, 1)]
    assert not graph.binders and not bound_kinds(backend)


@needs_native
def test_a_bound_call_reads_a_weight_where_its_storage_moved():
    generator = torch.Generator().manual_seed(3)
    layer = Int4Blocks.from_codes(
        torch.randint(0, 16, (32, 128), generator=generator, dtype=torch.uint8),
        torch.rand(32, 4, generator=generator) / 8, -torch.rand(32, 4, generator=generator),
    )
    x, norm = torch.randn(1, 128, generator=generator), torch.rand(128, generator=generator) + 0.5
    call = layer.bind_normed(x, norm, 1e-6)
    expected = layer.normed_matmul(x, norm, 1e-6)
    assert torch.equal(call(x), expected)
    original = layer.codes.view_as(layer.codes)  # keeps the first storage alive
    layer.codes.set_(layer.codes.clone())  # as stacking does: the same values elsewhere
    original.zero_()
    assert layer.codes.data_ptr() != original.data_ptr()
    assert torch.equal(call(x), expected)
