"""The native rope (native/common/rope.c) and its position table (plugins/backends/torch/rope.py):
the same bits as the torch backend's own rotation, for both kinds of rope, every layout it reads."""

from __future__ import annotations

import types

import pytest
import torch

from corral.ml import Rope, Yarn
from corral.plugins.backends.torch import context, native, rope as rope_table

pytestmark = pytest.mark.skipif(not native.has("rope_heads"), reason="no native kernels here")


def table_for(positions: torch.Tensor, rope: Rope, view=None):
    return context._rope_table(positions, rope, view)


ROPES = {
    "adjacent": Rope(dims=64, base=10000.0),
    "neox": Rope(dims=64, base=1000000.0, neox=True),
    "partial adjacent": Rope(dims=32, base=10000.0),
    "partial neox": Rope(dims=32, base=10000.0, neox=True),
    "yarn neox": Rope(dims=64, base=10000.0, scale=0.25, neox=True, yarn=Yarn(original_context=4096)),
    "scaled magnitude": Rope(dims=128, base=500000.0, attn_factor=1.3),
}


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_rope_heads_gives_the_bits_of_torchs_rope(name, rows):
    rope = ROPES[name]
    head_dim, heads, split = 64 if rope.dims <= 64 else rope.dims, 12, 9
    generator = torch.Generator().manual_seed(rows)
    positions = torch.randint(0, 5000, (rows,), generator=generator)
    table = table_for(positions, rope)
    pairs = rope_table.pairs_of(table, rope.neox)
    # a fused q/k/v output: q and k heads, then v's columns, read in place from their columns
    fused = torch.randn(rows, (heads + 3) * head_dim, generator=generator) * 30
    heads_view = fused[:, : heads * head_dim].reshape(rows, heads, head_dim)
    expected = context._rope(heads_view, table, rope.dims, rope.neox)
    q, k = native.rope_heads(fused, heads, split, head_dim, pairs, rope.dims, rope.neox)
    assert q.shape == (rows, split, head_dim) and k.shape == (rows, heads - split, head_dim)
    assert torch.equal(torch.cat((q, k), dim=1), expected)
    # and [rows, heads, head_dim] with its heads packed, as a single rope node passes it
    (alone, _) = native.rope_heads(heads_view.contiguous(), heads, heads, head_dim, pairs, rope.dims, rope.neox)
    assert torch.equal(alone, expected)


def test_rope_heads_refuses_a_table_of_other_rows():
    rope = ROPES["adjacent"]
    pairs = rope_table.pairs_of(table_for(torch.arange(2), rope), False)
    with pytest.raises(ValueError, match="for 3 rows"):
        native.rope_heads(torch.zeros(3, 4, 64), 4, 2, 64, pairs, 64, False)


@pytest.mark.parametrize("name", ["adjacent", "neox", "yarn neox"])
def test_the_position_table_gives_each_steps_own_bits_as_it_grows(name):
    rope = ROPES[name]
    rows = rope_table.RopeRows(rope, table_for)
    for positions in ([0, 1, 2], [7], [300, 301], [5], [1000, 4, 999], [255, 256]):
        at = torch.tensor(positions)
        got = rows.rows(at)
        assert torch.equal(got, rope_table.pairs_of(table_for(at, rope), rope.neox))  # as the step computes its own
    (table,) = rows._pairs.values()
    assert table.shape[0] == 1024  # doubled from 256 as positions arrived, not one row at a time


def test_positions_past_the_tables_limit_are_computed_at_the_step(monkeypatch):
    monkeypatch.setattr(rope_table, "MAX_BYTES", 4 * 64 * 300)  # 300 positions of 64 features
    rope = ROPES["neox"]
    rows = rope_table.RopeRows(rope, table_for)
    assert rows.limit == 300
    at = torch.tensor([10, 299])
    assert torch.equal(rows.rows(at), rope_table.pairs_of(table_for(at, rope), True))
    far = torch.tensor([10, 300, 70000])
    assert torch.equal(rows.rows(far), rope_table.pairs_of(table_for(far, rope), True))
    assert max(t.shape[0] for t in rows._pairs.values()) <= 300


def test_longrope_keeps_a_table_for_each_factor_set():
    short, long = torch.linspace(1.0, 2.0, 16), torch.linspace(1.0, 8.0, 16)
    rope = Rope(dims=32, base=10000.0, freq_factors=short, long_factors=long, original_context=4096)
    rows = rope_table.RopeRows(rope, table_for)
    at = torch.tensor([3, 50])
    small, large = types.SimpleNamespace(context_length=2048), types.SimpleNamespace(context_length=8192)
    got_short, got_long = rows.rows(at, small), rows.rows(at, large)
    assert torch.equal(got_short, rope_table.pairs_of(table_for(at, rope, small), False))
    assert torch.equal(got_long, rope_table.pairs_of(table_for(at, rope, large), False))
    assert not torch.equal(got_short, got_long) and set(rows._pairs) == {False, True}


def test_negative_positions_and_no_rows_are_computed_at_the_step():
    # A context shift turns cached keys back by the positions it drops: negative angles, never in the table
    rope = Rope(dims=64, base=10000.0, rotation_only=True)
    rows = rope_table.RopeRows(rope, table_for)
    back = torch.tensor([-7, -7, -7])
    assert torch.equal(rows.rows(back), rope_table.pairs_of(table_for(back, rope), False))
    assert rows.rows(torch.tensor([], dtype=torch.long)).shape[0] == 0
    assert not rows._pairs
