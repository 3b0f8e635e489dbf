"""The backend ops architectures build on, checked against plain torch written out here: expert
matmuls (reading only the chosen experts, batch-invariant), attention with soft-capped scores and
sinks, RoPE with frequency factors and YaRN, and the nested binding of shared blocks."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch

from corral.errors import MissingTensorError
from corral.kvcache import CausalCache
from corral.ml import Rope, Yarn
from corral.model import Batch, CacheLayer, TensorBinder, module, tensor
from corral.nn import Attention, GatedMLP, Linear, MoE, MoEOptions, RMSNorm, Vector
from corral.plugins.backends.torch.backend import TorchBackend
from corral.plugins.backends.torch.experts import ExpertWeights
from corral.plugins.backends.torch.layouts import DenseWeight, Int8Weight

EXPERTS, OUT, IN = 6, 16, 32


def expert_stack(layout: str, seed: int = 0) -> tuple[ExpertWeights, torch.Tensor]:
    weights = torch.randn(EXPERTS, OUT, IN, generator=torch.Generator().manual_seed(seed))
    if layout == "int8":
        parts = tuple(Int8Weight.quantize(w) for w in weights)
        return ExpertWeights(parts), torch.stack([p.dequantized() for p in parts])
    return ExpertWeights(tuple(DenseWeight(w) for w in weights)), weights


class Recording:
    """An expert that notes each call before computing it."""

    def __init__(self, inner, calls: list, index: int):
        self.inner, self.calls, self.index = inner, calls, index
        self.out_features = inner.weight.shape[0]

    def matmul(self, x, runs):
        self.calls.append(self.index)
        return self.inner.matmul(x, runs)


def constant(ctx, values) -> object:
    """A float tensor entering the graph as it is (ctx.input is for integer inputs)."""
    return ctx.record(torch.clone, torch.as_tensor(np.asarray(values)))


def run_ops(build, batch: Batch | None = None):
    """Record ops with `build(ctx)` on a float32 CPU backend and compute its outputs."""
    backend = TorchBackend("cpu", precision="fp32")
    ctx = backend.new_context(batch)
    outputs = build(ctx)
    return ctx.compute(*outputs) if isinstance(outputs, tuple) else ctx.compute(outputs)[0]


@pytest.mark.parametrize("layout", ["dense", "int8"])
def test_expert_linear_multiplies_each_slot_by_its_expert(layout):
    experts, weights = expert_stack(layout)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    ids = np.array([[0, 3], [3, 5], [1, 0], [5, 5], [2, 4]])
    bias = torch.randn(EXPERTS, OUT, generator=torch.Generator().manual_seed(2))
    out = run_ops(lambda ctx: ctx.expert_linear(constant(ctx, x), experts, ctx.input(ids), bias))
    expected = torch.einsum("ri,rkoi->rko", x, weights[torch.from_numpy(ids)]) + bias[torch.from_numpy(ids)]
    # int8 weights take bf16 activations: a few bf16 roundings of the scale
    torch.testing.assert_close(out, expected, rtol=0, atol=(2e-2 if layout == "int8" else 1e-6) * float(expected.abs().max()))


def test_expert_linear_takes_a_separate_input_per_slot():
    experts, weights = expert_stack("dense")
    x = torch.randn(3, 2, IN, generator=torch.Generator().manual_seed(3))
    ids = np.array([[1, 2], [2, 1], [0, 0]])
    out = run_ops(lambda ctx: ctx.expert_linear(constant(ctx, x), experts, ctx.input(ids)))
    expected = torch.einsum("rki,rkoi->rko", x, weights[torch.from_numpy(ids)])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_expert_linear_reads_only_the_chosen_experts_once_each():
    dense, _ = expert_stack("dense")
    calls: list[int] = []
    experts = ExpertWeights(tuple(Recording(e, calls, i) for i, e in enumerate(dense.experts)))
    ids = np.array([[4, 1], [1, 4], [4, 1]])
    run_ops(lambda ctx: ctx.expert_linear(constant(ctx, np.zeros((3, IN), dtype=np.float32)), experts, ctx.input(ids)))
    assert sorted(calls) == [1, 4]


def test_expert_linear_gives_a_sequence_the_same_bits_alone_and_batched():
    experts, _ = expert_stack("int8")
    rng = np.random.default_rng(4)
    alone_x, other_x = rng.standard_normal((4, IN), dtype=np.float32), rng.standard_normal((3, IN), dtype=np.float32)
    alone_ids, other_ids = rng.integers(0, EXPERTS, (4, 2)), rng.integers(0, EXPERTS, (3, 2))

    def batch_of(sequences):
        n = len(sequences)
        return Batch(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.asarray(sequences, np.int64), np.arange(n, dtype=np.int64))

    def product(x, ids, batch):
        return run_ops(lambda ctx: ctx.expert_linear(constant(ctx, x), experts, ctx.input(ids)), batch)

    alone = product(alone_x, alone_ids, batch_of([0] * 4))
    mixed = product(np.concatenate([other_x, alone_x]), np.concatenate([other_ids, alone_ids]), batch_of([1] * 3 + [0] * 4))
    assert torch.equal(mixed[3:], alone)


def naive_attention(q, k, v, scale, softcap=None, sinks=None):
    """Causal attention of one sequence [n, heads, d] written out in float64."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().reshape(-1, 1, 1).expand(heads, n, 1)), dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :n]
    return torch.einsum("hqk,khd->qhd", weights, v).reshape(n, -1).float()


@pytest.mark.parametrize(("softcap", "with_sinks"), [(None, False), (5.0, False), (None, True), (2.0, True)])
def test_attention_soft_caps_scores_and_adds_sinks(softcap, with_sinks):
    n, heads, kv_heads, dim = 6, 4, 2, 8
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, dim, generator=gen) * 2 for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    backend = TorchBackend("cpu", precision="fp32")
    cache = CausalCache(backend, [CacheLayer(kv_heads, dim, dim)], 16)
    batch = Batch.single(list(range(n)), all_logits=True)
    view = cache.prepare(batch)
    ctx = backend.new_context()
    node = ctx.attention(constant(ctx, q), constant(ctx, k), constant(ctx, v), view, 0, 0.3, softcap=softcap, sinks=sinks)
    (out,) = ctx.compute(node)
    torch.testing.assert_close(out.float(), naive_attention(q, k, v, 0.3, softcap, sinks), rtol=0, atol=1e-5)


def rotate(x: torch.Tensor, positions: np.ndarray, rope: Rope) -> torch.Tensor:
    return run_ops(lambda ctx: ctx.rope(constant(ctx, x), ctx.input(positions), rope))


def naive_neox_rope(x: torch.Tensor, positions: np.ndarray, angles_per_pair: torch.Tensor, magnitude: float = 1.0) -> torch.Tensor:
    """NeoX rotation by explicit angles [n, dims/2] (float64)."""
    half = angles_per_pair.shape[-1]
    x = x.double()
    cos, sin = angles_per_pair.cos()[:, None, :] * magnitude, angles_per_pair.sin()[:, None, :] * magnitude
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, x[..., 2 * half :]), dim=-1).float()


def test_rope_divides_each_frequency_by_its_factor():
    dims, base = 16, 10000.0
    x = torch.randn(5, 2, dims, generator=torch.Generator().manual_seed(6))
    positions = np.arange(3, 8)
    factors = torch.linspace(1.0, 8.0, dims // 2)
    inv = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims) / factors.double()
    angles = torch.from_numpy(positions).double()[:, None] * inv
    got = rotate(x, positions, Rope(dims=dims, base=base, neox=True, freq_factors=factors))
    torch.testing.assert_close(got, naive_neox_rope(x, positions, angles), rtol=0, atol=1e-5)


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_magnitude():
    dims, base, factor, trained = 32, 10000.0, 4.0, 4096
    x = torch.randn(4, 1, dims, generator=torch.Generator().manual_seed(7))
    positions = np.array([1, 50, 200, 1000])
    yarn = Yarn(original_context=trained, beta_fast=32.0, beta_slow=1.0)
    got = rotate(x, positions, Rope(dims=dims, base=base, scale=1 / factor, neox=True, yarn=yarn))

    def turning_pair(turns):  # the pair whose wavelength fits `turns` times into the trained context
        return dims * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(turning_pair(32.0))), min(dims - 1, math.ceil(turning_pair(1.0)))
    pairs = torch.arange(dims // 2, dtype=torch.float64)
    keep = 1 - ((pairs - low) / max(0.001, high - low)).clamp(0, 1)  # 1: extrapolate (unchanged), 0: interpolate
    inv = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    trained_angles = torch.from_numpy(positions).double()[:, None] * inv
    angles = trained_angles / factor * (1 - keep) + trained_angles * keep
    expected = naive_neox_rope(x, positions, angles, magnitude=1 + 0.1 * math.log(factor))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert 0 < low < high < dims // 2 - 1  # the check covers all three regimes


def test_a_rotation_only_rope_turns_yarn_keys_further_without_scaling_them_again():
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(8))
    positions, delta = np.array([3, 9, 40, 100]), 7
    rope = Rope(dims=32, base=10000.0, scale=1 / 4.0, neox=True, yarn=Yarn(original_context=256))
    shifted = rotate(rotate(x, positions, rope), np.full(4, delta), attrs.evolve(rope, rotation_only=True))
    torch.testing.assert_close(shifted, rotate(x, positions + delta, rope), rtol=0, atol=1e-5)


# --- nested binding -------------------------------------------------------------------------


class FakeFile:
    """A GGUF file's tensor index, for the binder's planning mode (no backend, nothing loaded)."""

    def __init__(self, names):
        self.path = "fake.gguf"
        self.tensors = {name: object() for name in names}


@attrs.frozen
class Block:
    norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn: GatedMLP | None = module(GatedMLP, "ffn_{}", optional=True)
    shared: GatedMLP | None = module(GatedMLP, "ffn_{}_shexp", optional=True)
    lone_bias: Linear | None = tensor("exp_probs_b", Linear, optional=True, suffix="bias")


def planned(names) -> tuple[Block, set[str]]:
    binder = TensorBinder(FakeFile(names), None)
    block = binder.bind(Block, "blk.0.")
    return block, {name for name, _ in binder.loaded}


ATTENTION = ["blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight"]


def test_modules_bind_their_tensors_under_the_pattern():
    names = ATTENTION + ["blk.0.attn_q.bias", "blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_shexp.weight", "blk.0.ffn_down_shexp.weight"]
    block, loaded = planned(names)
    assert loaded == set(names)
    assert block.ffn is None and block.shared is not None and block.attn.qkv is None and block.lone_bias is None


def test_a_tensor_can_be_a_lone_bias():
    block, loaded = planned(ATTENTION + ["blk.0.exp_probs_b.bias"])
    assert block.lone_bias is not None and "blk.0.exp_probs_b.bias" in loaded


def test_a_fused_projection_replaces_the_separate_ones():
    names = ["blk.0.attn_norm.weight", "blk.0.attn_qkv.weight", "blk.0.attn_output.weight"]
    block, loaded = planned(names)
    assert block.attn.qkv is not None and block.attn.q is None and loaded == set(names)


def test_attention_without_projections_is_a_missing_tensor():
    with pytest.raises(MissingTensorError, match="q, k and v"):
        planned(["blk.0.attn_norm.weight", "blk.0.attn_output.weight"])


# --- per-head products, group masks, grouped routing, unrounded YaRN ------------------------


def test_stacked_linear_multiplies_each_slot_by_its_own_matrix():
    experts, weights = expert_stack("dense")
    x = torch.randn(3, EXPERTS, IN, generator=torch.Generator().manual_seed(8))
    out = run_ops(lambda ctx: ctx.stacked_linear(constant(ctx, x), experts))
    torch.testing.assert_close(out, torch.einsum("rki,koi->rko", x, weights), rtol=0, atol=1e-5)


def test_stacked_linear_gives_a_sequence_the_same_bits_alone_and_batched():
    experts, _ = expert_stack("int8")
    rng = np.random.default_rng(9)
    alone_x, other_x = rng.standard_normal((1, EXPERTS, IN), dtype=np.float32), rng.standard_normal((5, EXPERTS, IN), dtype=np.float32)

    def product(x, sequences):
        n = len(sequences)
        batch = Batch(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.asarray(sequences, np.int64), np.arange(n, dtype=np.int64))
        return run_ops(lambda ctx: ctx.stacked_linear(constant(ctx, x), experts), batch)

    assert torch.equal(product(np.concatenate([other_x, alone_x]), [1] * 5 + [0])[5:], product(alone_x, [0]))


@pytest.mark.parametrize("layout", ["dense", "int8"])
def test_expert_linear_of_a_lone_row_has_the_bits_it_has_among_other_sequences_rows(layout):
    experts, _ = expert_stack(layout)
    rng = np.random.default_rng(13)
    x, ids = rng.standard_normal((3, IN), dtype=np.float32), np.array([[2, 5], [5, 0], [1, 2]])
    batch = Batch(np.zeros(3, np.int64), np.arange(3, dtype=np.int64), np.array([0, 1, 2]), np.arange(3, dtype=np.int64))
    together = run_ops(lambda ctx: ctx.expert_linear(constant(ctx, x), experts, ctx.input(ids)), batch)
    for row in range(3):
        lone = Batch.single([0], seq=row)
        alone = run_ops(lambda ctx: ctx.expert_linear(constant(ctx, x[row : row + 1]), experts, ctx.input(ids[row : row + 1])), lone)
        assert torch.equal(alone[0], together[row])


def test_keep_only_fills_every_entry_not_named():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    out = run_ops(lambda ctx: ctx.keep_only(constant(ctx, x), ctx.input(np.array([[3, 0], [1, 1]])), fill=-1.0))
    assert out.tolist() == [[1.0, -1.0, -1.0, 4.0], [-1.0, 6.0, -1.0, -1.0]]


@pytest.mark.parametrize("group_top", [1, 2])
def test_grouped_routing_chooses_only_from_the_best_groups(group_top):
    experts, groups, used, k = 8, 4, 2, 3
    gen = torch.Generator().manual_seed(10)
    x, router = torch.randn(6, IN, generator=gen), torch.randn(experts, IN, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.1
    moe = MoE(router=Linear(DenseWeight(router)), selection_bias=Vector(bias))
    opt = MoEOptions(k, gating="sigmoid", normalize=True, experts=experts, groups=groups, groups_used=used, group_top=group_top)
    weights, ids = run_ops(lambda ctx: moe.route(ctx, constant(ctx, x), opt))

    scores = torch.sigmoid(x @ router.T)
    choice = (scores + bias).reshape(6, groups, -1)
    best_groups = choice.topk(group_top, dim=-1).values.sum(-1).topk(used, dim=-1).indices
    allowed = torch.zeros(6, groups, dtype=torch.bool).scatter(1, best_groups, True).repeat_interleave(experts // groups, dim=1)
    expected_ids = choice.reshape(6, -1).masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
    expected = scores.gather(1, expected_ids)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True), rtol=0, atol=1e-6)


def test_unrounded_yarn_ramps_between_the_exact_turning_pairs():
    dims, base, factor, trained = 32, 10000.0, 4.0, 4096
    x = torch.randn(3, 1, dims, generator=torch.Generator().manual_seed(11))
    positions = np.array([3, 300, 3000])
    yarn = Yarn(original_context=trained, truncate=False)
    got = rotate(x, positions, Rope(dims=dims, base=base, scale=1 / factor, neox=True, yarn=yarn))

    def turning_pair(turns):
        return dims * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turning_pair(32.0), turning_pair(1.0)
    keep = 1 - ((torch.arange(dims // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    trained_angles = torch.from_numpy(positions).double()[:, None] / base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    angles = trained_angles / factor * (1 - keep) + trained_angles * keep
    torch.testing.assert_close(got, naive_neox_rope(x, positions, angles, magnitude=1 + 0.1 * math.log(factor)), rtol=0, atol=1e-4)
    assert low != math.floor(low) and high != math.ceil(high)  # rounding would have moved both ends


def linear_over_kept_rows(sequences, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A dense linear over all but the first row of a batch's activations (as LLaVA drops its class row before
    its projector): the result, the product written out, and how many matrix products it took."""
    import torch.nn.functional as F

    n = len(sequences)
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal((n, IN), dtype=np.float32), torch.from_numpy(rng.standard_normal((OUT, IN), dtype=np.float32))
    products, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda *args: products.append(1) or linear(*args))
    batch = Batch(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.asarray(sequences, np.int64), np.arange(n, dtype=np.int64))
    out = run_ops(lambda ctx: ctx.linear(ctx.split(constant(ctx, x), [1, n - 1], dim=0)[1], DenseWeight(w)), batch)
    return out, torch.from_numpy(x[1:]).double() @ w.double().T, len(products)


def test_an_encoder_pass_multiplies_the_rows_its_graph_kept_in_one_product(monkeypatch):
    out, expected, products = linear_over_kept_rows([0] * 65, monkeypatch)  # one sequence, no cache: an image's patches
    assert products == 1
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_rows_a_decode_batch_selects_stay_lone_rows(monkeypatch):
    """Two sequences: rows the runs do not cover are taken as single rows (in chunks), the batch-invariant decode path."""
    out, expected, products = linear_over_kept_rows([0] * 33 + [1] * 32, monkeypatch)
    assert products == 64 // 8
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_two_files_with_the_same_tensor_names_keep_their_own_weights_on_one_backend(tmp_path):
    # A model and its projector, or two models, may share a backend and tensor names: each gets its own.
    from corral.gguf import GGUFFile
    from tiny_gguf import write_tiny_llama

    backend = TorchBackend("cpu", precision="fp32")
    name = "blk.0.attn_q.weight"
    weights = []
    for seed in (1, 2):
        gguf = GGUFFile.open(write_tiny_llama(tmp_path / f"seed{seed}.gguf", seed=seed))
        weight = backend.load_tensor(gguf, gguf.tensors[name], "linear")
        assert isinstance(weight, DenseWeight)
        weights.append(weight.weight)
    assert not torch.equal(weights[0], weights[1])
    again = GGUFFile.open(tmp_path / "seed1.gguf")
    assert backend.load_tensor(again, again.tensors[name], "linear").weight is weights[0]  # one copy a file's tensor
