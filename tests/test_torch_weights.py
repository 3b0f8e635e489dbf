"""The torch backend's weight layouts (torch_weights.py) and its reuse of recorded graphs (torch_graph.py), on CPU."""

from __future__ import annotations

import attrs
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_gguf import VOCAB_SIZE, write_tensors, write_tiny_gemma3, write_tiny_llama

from corral.gguf import GGUFFile
from corral.topk import topk
from corral.kvcache import CausalCache
from corral.model import Batch
from corral.plugins.backends.torch import dequantize as torch_quant, int4_packing
from corral.plugins.backends.torch import context as torch_backend
from corral.plugins.backends.torch import attention as torch_attention, native as torch_native
from corral.plugins.backends.torch import layouts as torch_weights
from corral.plugins.backends.torch import TorchBackend
from corral.plugins.backends.torch import fusion as torch_fusion
from corral.plugins.backends.torch.fusion import stack_weights
from corral.plugins.backends.torch.graph import Graph, Slot, sequence_runs
from corral.plugins.backends.torch.layouts import (
    LONG_RUN_ROWS, RESCORE_TOP, DenseWeight, Int4Blocks, Int4Weight, Int8Weight, MappedRows, RescoredLogits, int8_matmul,
    requantized_int4,
)
from corral.registry import Plugins

Q = gguf.GGMLQuantizationType
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB_SIZE, 9)]


def randn(*shape: int, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def quantized_rows(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw bytes [rows, row_bytes] of random weights quantized by gguf, and their exact float32 values."""
    values = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(values, qtype))
    return raw, torch_quant.dequantize(raw, qtype, cols)


@pytest.fixture
def weight() -> torch.Tensor:
    w = randn(24, 64, std=0.05)
    w[3] *= 1000  # rows of very different ranges
    w[5] = 0  # an all-zero row
    return w


# --- Int8Weight -------------------------------------------------------------------------------------
def test_int8_quantize_scales_are_exact_bf16_and_codes_fit_in_int8(weight):
    q = Int8Weight.quantize(weight)
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    assert torch.equal(q.scales.float().to(torch.bfloat16).float(), q.scales.float())
    assert (q.scales.float() > 0).all()
    assert q.codes.int().abs().max() <= 127


def test_int8_dequantized_is_within_half_a_scale_of_the_weight(weight):
    q = Int8Weight.quantize(weight)
    error = (q.dequantized() - weight).abs()
    assert (error <= q.scales.float()[:, None] / 2).all()
    assert torch.equal(q.dequantized()[5], torch.zeros(64))


def test_int8_matmul_rows_are_the_same_alone_and_batched(weight):
    q = Int8Weight.quantize(weight)
    x = randn(7, 64, seed=1)
    for runs in ([(i, i + 1) for i in range(7)], None):
        batched = q.matmul(x, runs)
        for i in range(7):
            assert torch.equal(q.matmul(x[i : i + 1], [(0, 1)])[0], batched[i])


def test_int8_matmul_single_rows_next_to_a_long_run_are_the_same_as_alone(weight):
    q = Int8Weight.quantize(weight)
    n = LONG_RUN_ROWS
    x = randn(n + 2, 64, seed=2)
    batched = q.matmul(x, [(0, n), (n, n + 1), (n + 1, n + 2)])
    assert torch.equal(batched[:n], q.matmul(x[:n], [(0, n)]))
    for i in (n, n + 1):
        assert torch.equal(batched[i], q.matmul(x[i : i + 1], [(0, 1)])[0])


@pytest.mark.parametrize("rows", [LONG_RUN_ROWS, LONG_RUN_ROWS + 9])
def test_int8_matmul_of_a_long_run_matches_the_dequantized_weight(weight, rows):
    q = Int8Weight.quantize(weight)
    x = randn(rows, 64, seed=3)
    expected = x @ q.dequantized().T
    got = q.matmul(x, [(0, rows)]).float()
    assert got.shape == (rows, 24)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * expected.abs().max().item())


def test_int8_prompt_path_matches_the_int8_weights_closely_despite_an_outlier_feature(weight):
    q = Int8Weight.quantize(weight)
    x = randn(LONG_RUN_ROWS + 5, 64, seed=7)
    x[:, 3] *= 200  # one feature far larger than the rest, as real residual streams have
    x[4] = 0
    expected = x.double() @ q.dequantized().double().T
    got = int8_matmul(x, q.codes, q.scales)
    assert got.dtype == torch.float32 and torch.equal(got[4], torch.zeros(24))
    # two int8 levels leave ~1/32000 of each row's largest value; one level would leave ~1/254
    for row in range(len(x)):
        bound = 1e-4 * float(x[row].abs().max() * q.dequantized().abs().sum(dim=1).max())
        assert (got[row].double() - expected[row]).abs().max() <= bound


def test_int8_prompt_path_rows_are_the_same_alone_and_batched(weight):
    q = Int8Weight.quantize(weight)
    x = randn(40, 64, seed=8)
    batched = int8_matmul(x, q.codes, q.scales)
    for i in (0, 17, 39):
        assert torch.equal(int8_matmul(x[i : i + 1], q.codes, q.scales)[0], batched[i])


def test_int8_matmul_of_single_rows_matches_the_dequantized_weight_to_bf16_rounding(weight):
    q = Int8Weight.quantize(weight)
    x = randn(5, 64, seed=4)
    expected = x @ q.dequantized().T
    torch.testing.assert_close(q.matmul(x, None).float(), expected, rtol=0, atol=1e-2 * expected.abs().max().item())


def test_int4_matmul_of_a_long_run_uses_the_files_exact_weights():
    raw, exact = quantized_rows(Q.Q4_0, rows=32, cols=64, seed=15)
    codes, scales, zeros = torch_quant.int4_codes(raw, Q.Q4_0, 64)
    packed, sz = int4_packing.pack_int4_for_cpu(codes, scales, zeros)
    weight = Int4Weight(packed, sz, 32, 64, MappedRows(raw, Q.Q4_0, 64))
    x = randn(LONG_RUN_ROWS + 3, 64, seed=16)
    got = weight.matmul(x, [(0, LONG_RUN_ROWS + 3)]).float()
    torch.testing.assert_close(got, (x @ exact.T).bfloat16().float(), rtol=0, atol=1e-6)
    # single rows take the int4 kernel: same values to its bf16 rounding
    alone = weight.matmul(x[:2], [(0, 1), (1, 2)]).float()
    torch.testing.assert_close(alone, x[:2] @ exact.T, rtol=0, atol=2e-2 * float((x[:2] @ exact.T).abs().max()))


# --- MappedRows and RescoredLogits ----------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_mapped_rows_equal_dequantize_of_the_same_raw_rows(qtype):
    raw, _ = quantized_rows(qtype, rows=10, cols=64)
    table = MappedRows(raw, qtype, 64)
    ids = torch.tensor([[3, 0], [3, 9]])
    assert table.shape == (10, 64) and table.nbytes == 0
    assert torch.equal(table.rows(ids), torch_quant.dequantize(raw[[3, 0, 3, 9]], qtype, 64))


@pytest.fixture(params=["int4", "int8"])
def logits_layer(request) -> tuple[RescoredLogits, torch.Tensor]:
    raw, exact = quantized_rows(Q.Q8_0, rows=512, cols=64, seed=5)
    approx = requantized_int4(raw, Q.Q8_0, 64) if request.param == "int4" else Int8Weight.quantize(exact)
    return RescoredLogits(approx, MappedRows(raw, Q.Q8_0, 64)), exact


def test_int4_requantize_rounds_each_group_to_within_half_a_step():
    weight = randn(32, 96, seed=11)
    codes, scales, mins = torch_weights.int4_requantize(weight)
    assert int(codes.max()) <= 15
    rebuilt = codes.float().view(32, 3, 32) * scales[..., None] + mins[..., None]
    assert ((rebuilt.view(32, 96) - weight).abs() <= scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def test_requantized_int4_matmul_approximates_the_exact_product():
    raw, exact = quantized_rows(Q.Q8_0, rows=64, cols=64, seed=12)
    x = randn(3, 64, seed=13)
    expected = x @ exact.T
    got = requantized_int4(raw, Q.Q8_0, 64)._kernel(x).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.1 * expected.abs().max().item())


def test_rescored_logits_rescores_the_top_candidates_exactly(logits_layer):
    layer, exact = logits_layer
    x = randn(6, 64, seed=6)
    got, expected = layer.matmul(x), x @ exact.T
    top = layer.approximate(x).topk(RESCORE_TOP, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), expected.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_rescored_logits_rows_are_the_same_alone_and_batched(logits_layer):
    layer, _ = logits_layer
    x = randn(6, 64, seed=7)
    batched = layer.matmul(x)
    for i in range(6):
        assert torch.equal(layer.matmul(x[i : i + 1])[0], batched[i])


def test_rescored_logits_of_no_rows_is_empty(logits_layer):
    layer, _ = logits_layer
    got = layer.matmul(torch.zeros(0, 64))
    assert got.shape == (0, 512) and got.dtype == torch.float32


# --- TorchBackend.load_tensor -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> GGUFFile:
    path = tmp_path_factory.mktemp("weights") / "weights.gguf"
    rng = np.random.default_rng(0)
    shapes = {"q4": (Q.Q4_0, (32, 64)), "q4_8rows": (Q.Q4_0, (8, 64)), "q8": (Q.Q8_0, (16, 64)), "f32": (Q.F32, (16, 64))}
    tensors = {name: (rng.normal(0, 0.05, shape).astype(np.float32), qtype) for name, (qtype, shape) in shapes.items()}
    write_tensors(gguf.GGUFWriter(str(path), "llama"), tensors, rng)
    return GGUFFile.open(path)


@pytest.mark.parametrize(
    ("precision", "name", "role", "layout"),
    [
        ("auto", "q4", "linear", Int4Blocks if torch_native.has("int4_blocks_matmul") else Int4Weight),
        ("auto", "q4_8rows", "linear", Int8Weight),  # too few rows for the CPU int4 kernel
        ("auto", "q8", "linear", Int8Weight),
        ("auto", "q8", "logits", RescoredLogits),
        ("auto", "q8", "embedding", MappedRows),
        ("auto", "f32", "linear", DenseWeight),
        ("fp32", "q8", "linear", DenseWeight),
        ("fp32", "q4", "linear", DenseWeight),
    ],
)
def test_load_tensor_picks_the_layout_for_the_role(weights_file, precision, name, role, layout):
    backend = TorchBackend(device="cpu", precision=precision)
    assert type(backend.load_tensor(weights_file, weights_file.tensors[name], role)) is layout


def test_load_tensor_fp32_linear_is_the_exact_dequantized_weight(weights_file):
    info = weights_file.tensors["q8"]
    loaded = TorchBackend(device="cpu", precision="fp32").load_tensor(weights_file, info, "linear")
    expected = torch_quant.dequantize(torch.from_numpy(weights_file.raw("q8")), Q.Q8_0, 64)
    assert loaded.weight.dtype == torch.float32 and torch.equal(loaded.weight, expected)


# --- Graph reuse ------------------------------------------------------------------------------------
class Counting:
    """A model whose forward calls are counted; `copy_inputs` feeds the graph a copy of the batch's tokens."""

    def __init__(self, model, copy_inputs: bool = False):
        self.model, self.copy_inputs, self.calls = model, copy_inputs, 0

    def cache_layers(self):
        return self.model.cache_layers()

    def forward(self, ctx, batch, view):
        self.calls += 1
        if self.copy_inputs:
            batch = attrs.evolve(batch, inputs=batch.inputs.copy())
        return self.model.forward(ctx, batch, view)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    # A Q8_0 tied embedding: MappedRows lookups and RescoredLogits run in the graph too.
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny.gguf", tensor_types={"token_embd.weight": Q.Q8_0})


def load(path: str, precision: str, architecture: str = "llama"):
    backend = TorchBackend(device="cpu", precision=precision)
    return backend, Plugins().architectures()[architecture].from_gguf(GGUFFile.open(path), backend)


def steps() -> list[Batch]:
    """A 5-token prompt, then one decode step per following token."""
    return [Batch.single(TOKENS[:5])] + [Batch.single([t], start=i) for i, t in enumerate(TOKENS[5:], start=5)]


def run_fresh(path: str, precision: str, optimize: bool = True, architecture: str = "llama") -> list[torch.Tensor]:
    """Each step through a freshly recorded context, on a backend of its own; rewritten by the
    fusion passes unless not `optimize`."""
    backend, model = load(path, precision, architecture)
    cache, out = CausalCache(backend, model.cache_layers(), 32), []
    for batch in steps():
        view = cache.prepare(batch)
        ctx = backend.new_context(batch, view)
        output = model.forward(ctx, batch, view)
        out.extend(ctx.compute(ctx.optimize(output) if optimize else output))
    return out


def run_reused(path: str, precision: str, copy_inputs: bool = False, architecture: str = "llama"):
    """Each step through backend.run (graphs reused by shape): the logits, the counting model, the backend."""
    backend, model = load(path, precision, architecture)
    counting = Counting(model, copy_inputs)
    cache = CausalCache(backend, model.cache_layers(), 32)
    return [backend.run(counting, batch, cache.prepare(batch)) for batch in steps()], counting, backend


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_reused_decode_graph_gives_the_same_bits_as_fresh_recordings(llama_path, precision):
    reused, _, _ = run_reused(llama_path, precision)
    fresh = run_fresh(llama_path, precision)
    assert len(reused) == len(fresh) == 5
    for got, expected in zip(reused, fresh):
        assert got.shape == (1, VOCAB_SIZE) and torch.equal(got, expected)


def test_decode_steps_of_one_shape_record_the_model_once(llama_path):
    _, counting, backend = run_reused(llama_path, "auto")
    assert counting.calls == 2  # the prompt, then the first decode step
    assert set(backend._graphs._graphs) == {(5, 1), (1, 1)}


def test_graph_fed_arrays_other_than_the_batchs_is_not_kept(llama_path):
    reused, counting, backend = run_reused(llama_path, "auto", copy_inputs=True)
    assert counting.calls == 5 and not backend._graphs._graphs
    for got, expected in zip(reused, run_fresh(llama_path, "auto")):
        assert torch.equal(got, expected)


def test_graph_fed_a_copy_of_the_batchs_tokens_is_not_replayable(llama_path):
    backend, model = load(llama_path, "auto")
    batch = Batch.single(TOKENS[:3])
    view = CausalCache(backend, model.cache_layers(), 32).prepare(batch)
    ctx = backend.new_context(batch, view)
    Counting(model, copy_inputs=True).forward(ctx, batch, view)
    assert not ctx.replayable
    ctx = backend.new_context(batch, view)
    model.forward(ctx, batch, view)
    assert ctx.replayable


# --- attention ------------------------------------------------------------------------------------
def attention_rows(order: list[int], new_rows: int = 3) -> dict[tuple[int, int], torch.Tensor]:
    """Attention output of each (sequence, position) row when 2 sequences' next rows come in `order`."""
    from corral.model import CacheLayer

    cache = CausalCache(TorchBackend("cpu"), [CacheLayer(kv_heads=2, key_dim=8, value_dim=8)], 128, num_seqs=2)
    for seq in (0, 1):  # a 40-row prompt each (the float32 prompt path), then `new_rows` decode-length runs
        cache.prepare(Batch(np.zeros(40, np.int64), np.arange(40), np.full(40, seq), np.array([39])))
    seqs = np.array(order)
    positions = np.array([40 + int((seqs[:i] == s).sum()) for i, s in enumerate(seqs)])
    view = cache.prepare(Batch(np.zeros(len(seqs), np.int64), positions, seqs, np.arange(len(seqs))))
    q, k, v = (randn(len(seqs), heads, 8, seed=20 + heads) for heads in (4, 2, 2))
    for i in range(len(seqs)):  # each row's own q/k/v, whatever its place in the batch
        row_seed = 100 * int(seqs[i]) + int(positions[i])
        q[i], k[i], v[i] = randn(4, 8, seed=row_seed), randn(2, 8, seed=row_seed + 1), randn(2, 8, seed=row_seed + 2)
    out = torch_attention.attention(q, k, v, view, 0, 0.35)
    return {(int(s), int(p)): out[i] for i, (s, p) in enumerate(zip(seqs, positions))}


def test_attention_rows_are_the_same_whatever_order_the_sequences_interleave_in():
    in_order = attention_rows([0, 0, 0, 1, 1, 1])
    interleaved = attention_rows([1, 0, 0, 1, 0, 1])
    assert in_order.keys() == interleaved.keys()
    for row, value in in_order.items():
        assert value.shape == (32,) and torch.equal(value, interleaved[row]), row


def prompt_rows(seqs: list[int], length: int = 40) -> tuple[dict[int, torch.Tensor], dict[int, tuple]]:
    """Attention of a `length`-row prompt per sequence, all in one batch; and each one's q, k, v."""
    from corral.model import CacheLayer

    cache = CausalCache(TorchBackend("cpu"), [CacheLayer(kv_heads=2, key_dim=8, value_dim=8)], 2 * 64, num_seqs=2)
    n = length * len(seqs)
    batch = Batch(np.zeros(n, np.int64), np.tile(np.arange(length), len(seqs)), np.repeat(seqs, length), np.array([n - 1]))
    inputs = {s: (randn(length, 4, 8, seed=60 + s), randn(length, 2, 8, seed=70 + s), randn(length, 2, 8, seed=80 + s)) for s in seqs}
    q, k, v = (torch.cat([inputs[s][j] for s in seqs]) for j in range(3))
    out = torch_attention.attention(q, k, v, cache.prepare(batch), 0, 0.35)
    return {s: out[i * length : (i + 1) * length] for i, s in enumerate(seqs)}, inputs


def test_prompt_runs_attend_in_float32_the_same_alone_and_batched():
    batched, inputs = prompt_rows([0, 1])
    for seq in (0, 1):
        alone, _ = prompt_rows([seq])
        assert torch.equal(batched[seq], alone[seq])
        # causal attention over the bf16-stored keys in float64, rounded to the cache's bf16: the
        # float32 path lands on the same bf16 value almost everywhere (bf16 queries would not)
        q = inputs[seq][0].double()
        k, v = (t.bfloat16().double().transpose(0, 1).repeat_interleave(2, 0) for t in inputs[seq][1:])
        expected = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.35)
        expected = expected.transpose(0, 1).reshape(40, -1).bfloat16()
        assert (batched[seq] == expected).float().mean() > 0.98


def decode_rows(lengths: dict[int, int], order: list[int], kv_heads: int = 2, dim: int = 8) -> dict[int, torch.Tensor]:
    """Attention output of one decode row (4 query heads) per sequence in `order`, each sequence holding `lengths[seq]` cells."""
    from corral.model import CacheLayer

    cache = CausalCache(TorchBackend("cpu"), [CacheLayer(kv_heads=kv_heads, key_dim=dim, value_dim=dim)], 4 * 64, num_seqs=4)
    for seq, length in lengths.items():
        view = cache.prepare(Batch(np.zeros(length, np.int64), np.arange(length), np.full(length, seq), np.array([length - 1])))
        keys, values = randn(length, kv_heads, dim, seed=seq), randn(length, kv_heads, dim, seed=10 + seq)  # distinct per sequence
        torch_attention.attention(randn(length, 4, dim, seed=50 + seq), keys, values, view, 0, 0.35)
    seqs = np.array(order)
    positions = np.array([lengths[s] for s in order])
    view = cache.prepare(Batch(np.zeros(len(seqs), np.int64), positions, seqs, np.arange(len(seqs))))
    q = torch.stack([randn(4, dim, seed=200 + s) for s in order])
    k = torch.stack([randn(kv_heads, dim, seed=300 + s) for s in order])
    v = torch.stack([randn(kv_heads, dim, seed=400 + s) for s in order])
    out = torch_attention.attention(q, k, v, view, 0, 0.35 / dim**0.5 * 8**0.5)
    return {int(s): out[i] for i, s in enumerate(seqs)}


@pytest.mark.parametrize(
    "lengths, order",
    [
        ({0: 9, 1: 9, 2: 9, 3: 9}, [0, 1, 2, 3]),  # regions evenly spaced: one call over a view
        ({0: 9, 1: 9, 2: 9, 3: 9}, [3, 0, 2]),  # unevenly spaced: gathered
        ({0: 9, 1: 5, 2: 9, 3: 5}, [2, 1, 0, 3]),  # two lengths: two calls
    ],
)
def test_decode_rows_attend_the_same_batched_as_alone(lengths, order):
    batched = decode_rows(lengths, order)
    for seq in order:
        alone = decode_rows({seq: lengths[seq]}, [seq])[seq]
        assert alone.shape == (32,) and torch.equal(batched[seq], alone), seq


def test_decode_rows_of_a_single_kv_head_attend_the_same_batched_as_alone():
    # One sequence over one kv head is a single work item for SDPA, which then lets MKL multithread
    # its products (another summation order) unless the call is arranged as for two; Gemma 3 270M's
    # shape, over many lengths (a mismatch needs particular values), on two threads or more.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        for length in range(1, 64):  # before the fix: lengths 19 and 20 differed
            lengths = {0: length, 1: length, 2: length, 3: length}
            batched = decode_rows(lengths, [0, 1, 2, 3], kv_heads=1, dim=256)
            for seq in range(4):
                alone = decode_rows({seq: length}, [seq], kv_heads=1, dim=256)[seq]
                assert torch.equal(batched[seq], alone), (length, seq)
    finally:
        torch.set_num_threads(threads)


# --- sequence_runs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sequences", "runs"),
    [
        ([], []), ([4], [(0, 1)]), ([2, 2, 2], [(0, 3)]), ([0, 1, 2], [(0, 1), (1, 2), (2, 3)]),
        ([1, 1, 0, 0, 0, 1], [(0, 2), (2, 5), (5, 6)]), ([5, 7, 5, 5], [(0, 1), (1, 2), (2, 4)]),
    ],
)
def test_sequence_runs_splits_rows_where_the_sequence_changes(sequences, runs):
    assert sequence_runs(np.array(sequences, dtype=np.int64)) == runs


# --- fusion of linears sharing an input ---------------------------------------------------------------
def int4_weight(rows: int, cols: int = 64, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    scales, zeros = torch.rand(rows, cols // 32, generator=gen), torch.rand(rows, cols // 32, generator=gen)
    packed, sz = int4_packing.pack_int4_for_cpu(codes, scales, zeros)
    return Int4Weight(packed, sz, rows, cols)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_stacked_weight_computes_each_part_and_shares_their_storage(kind):
    if kind == "int4":
        parts = [int4_weight(rows, seed=i) for i, rows in enumerate((128, 64, 64))]
    else:
        parts = [Int8Weight.quantize(randn(rows, 64, seed=i)) for i, rows in enumerate((48, 16, 16))]
    x = randn(3, 64, seed=9)
    separate = torch.cat([part.matmul(x) for part in parts], dim=1)
    stacked = stack_weights(parts)
    assert torch.equal(stacked.matmul(x), separate)
    big = stacked.packed if kind == "int4" else stacked.codes
    for part in parts:  # each original is now a view into the stacked copy
        own = part.packed if kind == "int4" else part.codes
        assert own.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()


def test_int4_weights_of_partial_packing_blocks_do_not_stack():
    assert stack_weights([int4_weight(64), int4_weight(16)]) is None
    assert stack_weights([int4_weight(64), Int8Weight.quantize(randn(64, 64))]) is None


def test_fusion_runs_linears_of_one_input_as_one_and_gives_the_same_result():
    backend = TorchBackend(precision="auto")
    parts = [Int8Weight.quantize(randn(rows, 64, seed=i)) for i, rows in enumerate((32, 16, 16))]
    x = randn(2, 64, seed=10)

    def record():
        ctx = backend.new_context()
        h = ctx.record(lambda: x)
        q, k, v = (ctx.linear(h, w) for w in parts)
        return ctx, ctx.record(lambda a, b, c: torch.cat((a, b, c), dim=1), q, k, v)

    ctx, out = record()
    (expected,) = ctx.compute(out)
    ctx, out = record()
    out = ctx.optimize(out)
    linears = [args for fn, args in ctx.nodes if fn is torch_backend._linear]
    assert len(linears) == 1 and linears[0][1].codes.shape == (64, 64)
    assert torch.equal(ctx.compute(out)[0], expected)


@pytest.mark.parametrize("vocab", [512, 262144])
def test_two_stage_topk_is_torchs(vocab):
    logits = randn(3, vocab, seed=14)
    values, ids = topk(logits, 128)
    expected = logits.topk(128, dim=-1)
    assert torch.equal(values, expected.values)  # largest first
    assert torch.equal(logits.gather(1, ids), values)
    assert torch.equal(ids.sort(dim=-1).values, expected.indices.sort(dim=-1).values)


LINEARS = (torch_backend._linear, torch_backend._normed_linear)  # a fused linear's node, its input normed or not


def without_native_rope(monkeypatch) -> None:
    """Backends built from here on rotate with torch's `_rope` (rope_heads reported missing)."""
    available = TorchBackend.native
    monkeypatch.setattr(TorchBackend, "native", lambda self, name: name != "rope_heads" and available(self, name))


@pytest.mark.parametrize("native_rope", [True, False], ids=["native rope", "torch rope"])
def test_q_and_k_rotate_in_one_rope_call_with_the_same_bits(tmp_path, monkeypatch, native_rope):
    # int8 q/k/v stack into one linear, whose q and k column parts then rotate together
    monkeypatch.setattr(torch_backend, "fuse_gates", lambda graph, outputs, *_: outputs)  # not bit-exact: tested below
    types = {f"blk.{i}.attn_{part}.weight": Q.Q8_0 for i in range(2) for part in "qkv"}
    path = write_tiny_llama(tmp_path / "int8_qkv.gguf", tensor_types=types)
    if native_rope and not torch_native.has("rope_heads"):
        pytest.skip("no native kernels here")
    with monkeypatch.context() as patched:
        if not native_rope:
            without_native_rope(patched)
        reused, _, backend = run_reused(path, "auto")  # graphs rewritten by the fusion passes
        fresh = run_fresh(path, "auto", optimize=False)  # as written: two ropes a layer
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    functions = [fn for fn, _ in graph.nodes]
    if native_rope:  # q and k read from the fused output's columns and rotated by one native call
        joint = [args for fn, args in graph.nodes if fn is torch_backend._rope_columns]
        assert len(joint) == 2 and torch_backend._rope not in functions and torch_fusion._column_heads not in functions
        assert all(graph.nodes[args[0].index][0] in LINEARS for args in joint)
        assert torch_fusion._split_columns not in functions  # v, the split's last reader, is a column slice
    else:
        ropes = [args for fn, args in graph.nodes if fn is torch_backend._rope]
        assert len(ropes) == 2  # one per layer of the tiny model, q and k together
        assert all(graph.nodes[args[0].index][0] is torch_fusion._column_heads for args in ropes)
    for got, expected in zip(reused, fresh):
        assert torch.equal(got, expected)


def test_the_native_rope_gives_torchs_bits_through_the_model(tmp_path, monkeypatch):
    # Every step, prompt and decode, with the native rope (and its position table) and with torch's.
    if not torch_native.has("rope_heads"):
        pytest.skip("no native kernels here")
    types = {f"blk.{i}.attn_{part}.weight": Q.Q8_0 for i in range(2) for part in "qkv"}
    path = write_tiny_llama(tmp_path / "int8_qkv.gguf", tensor_types=types)
    native_steps, _, _ = run_reused(path, "auto")
    without_native_rope(monkeypatch)
    torch_steps, _, backend = run_reused(path, "auto")
    assert not backend.native("rope_heads")
    for got, expected in zip(native_steps, torch_steps, strict=True):
        assert torch.equal(got, expected)


def test_gated_halves_are_read_in_place_with_the_same_bits(tmp_path, monkeypatch):
    # int8 gate and up stack into one linear, whose two halves the gated kernel reads in place
    types = {f"blk.{i}.ffn_{part}.weight": Q.Q8_0 for i in range(2) for part in ("gate", "up")}
    path = write_tiny_llama(tmp_path / "int8_gate_up.gguf", tensor_types=types)
    reused, _, backend = run_reused(path, "auto")
    if not backend.native("gated"):
        pytest.skip("no native kernels here")
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    functions = [fn for fn, _ in graph.nodes]
    assert torch_backend._gated_halves in functions and torch_backend._gated not in functions
    halves = [args for fn, args in graph.nodes if fn is torch_backend._gated_halves]
    assert len(halves) == 2 and all(graph.nodes[args[0].index][0] in LINEARS for args in halves)
    monkeypatch.setattr(torch_backend, "fuse_gated_halves", lambda graph, outputs, *_: outputs)  # the halves cut out first
    for got, expected in zip(reused, run_fresh(path, "auto"), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["int4 blocks", "int8 rows"])
def test_a_norm_feeding_a_linear_runs_in_its_kernel_call_with_the_same_bits(tmp_path, monkeypatch, qtype):
    types = {f"blk.{i}.{name}.weight": qtype for i in range(2) for name in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")}
    path = write_tiny_llama(tmp_path / "normed.gguf", tensor_types=types)
    reused, _, backend = run_reused(path, "auto")
    if not backend.native("rms_norm"):
        pytest.skip("no native kernels here")
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    normed = [args for fn, args in graph.nodes if fn is torch_backend._normed_linear]
    assert len(normed) == 4  # the attention's and the feed-forward's inputs of both layers
    assert {type(args[3]) for args in normed} == {torch_weights.Int4Blocks if qtype == Q.Q4_0 else torch_weights.Int8Weight}
    monkeypatch.setattr(torch_backend, "fuse_norms", lambda graph, outputs, *_: outputs)  # the norm a node of its own
    for got, expected in zip(reused, run_fresh(path, "auto"), strict=True):  # the prompt's rows and the decode steps'
        assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["int4 blocks", "int8 rows"])
def test_a_linear_added_to_the_residual_sums_in_its_kernel_call_with_the_same_bits(tmp_path, monkeypatch, qtype):
    types = {f"blk.{i}.{name}.weight": qtype for i in range(2) for name in ("attn_output", "ffn_down")}
    path = write_tiny_llama(tmp_path / "added.gguf", tensor_types=types)
    reused, _, backend = run_reused(path, "auto")
    if not torch_native.has("int4_blocks_added"):
        pytest.skip("no native kernels here")
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    added = [args for fn, args in graph.nodes if fn is torch_backend._added_linear]
    assert len(added) == 4 and torch.add not in [fn for fn, _ in graph.nodes]  # both residual sums of both layers
    monkeypatch.setattr(torch_backend, "fuse_residuals", lambda graph, outputs, *_: outputs)  # the sum a node of its own
    for got, expected in zip(reused, run_fresh(path, "auto"), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["int4 blocks", "int8 rows"])
def test_a_post_normed_linear_added_to_the_residual_runs_in_its_kernel_call_with_the_same_bits(tmp_path, monkeypatch, qtype):
    # Gemma 3: residual + rms_norm(linear(x)) after the attention and after the feed-forward
    types = {f"blk.{i}.{name}.weight": qtype for i in range(6) for name in ("attn_output", "ffn_down")}
    path = write_tiny_gemma3(tmp_path / "post_normed.gguf", tensor_types=types)
    reused, _, backend = run_reused(path, "auto", architecture="gemma3")
    if not torch_native.has("int4_blocks_added"):
        pytest.skip("no native kernels here")
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    added = [args for fn, args in graph.nodes if fn is torch_backend._added_linear]
    assert len(added) == 12 and all(args[4] is not None for args in added)  # both post-norms of the 6 blocks
    monkeypatch.setattr(torch_backend, "fuse_residuals", lambda graph, outputs, *_: outputs)
    for got, expected in zip(reused, run_fresh(path, "auto", architecture="gemma3"), strict=True):
        assert torch.equal(got, expected)


def test_the_added_kernels_give_torchs_sum_and_take_only_a_residual_of_the_outputs_shape():
    if not torch_native.has("int4_blocks_added"):
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 128, generator=generator), torch.randn(5, 64, generator=generator) * 10
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=generator)
    int4 = torch_weights.Int4Blocks.from_codes(codes, torch.rand(64, 4, generator=generator) / 8, -torch.rand(64, 4, generator=generator))
    int8 = torch_weights.Int8Weight.quantize(torch.randn(64, 128, generator=generator))
    norm = torch.rand(64, generator=generator) + 0.5
    for weight in (int4, int8):
        assert torch.equal(weight.added_matmul(x, residual), torch.add(residual, weight.matmul(x)))
        normed = torch_native.rms_norm(weight.matmul(x), norm, 1e-6)
        assert torch.equal(weight.added_matmul(x, residual, None, norm, 1e-6), torch.add(residual, normed))
        row = residual[:1]  # broadcast over the rows: not the kernel's, torch's add still gives the sum
        assert torch.equal(weight.added_matmul(x, row), torch.add(row, weight.matmul(x)))
    assert not torch_native.takes_residual(residual.t(), 64, 5) and torch_native.takes_residual(residual, 5, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_normed_kernels_give_the_bits_of_a_norm_then_the_kernel(dtype, rows):
    if not (torch_native.has("int4_blocks_normed") and torch_native.has("int8_rows_normed")):
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 128, generator=generator) * 4).to(dtype)
    norm = torch.rand(128, generator=generator) + 0.5
    normed = torch_native.rms_norm(x, norm, 1e-6)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=generator)
    scales, mins = torch.rand(64, 4, generator=generator) / 8, -torch.rand(64, 4, generator=generator)
    int4 = torch_weights.Int4Blocks.from_codes(codes, scales, mins)
    assert torch.equal(int4.normed_matmul(x, norm, 1e-6), int4.matmul(normed))
    int8 = torch_weights.Int8Weight.quantize(torch.randn(64, 128, generator=generator))
    assert torch.equal(torch_native.int8_rows_normed(x, norm, 1e-6, int8.codes, int8.scales), torch_native.int8_rows_matmul(normed, int8.codes, int8.scales))


def test_gated_activations_run_as_one_node_close_to_torchs(llama_path):
    reused, _, backend = run_reused(llama_path, "auto")
    _, graph, _ = backend._graphs._graphs[(1, 1)]
    functions = [fn for fn, _ in graph.nodes]
    if backend.native("gated"):
        assert torch_backend._gated in functions and F.silu not in functions and torch.mul not in functions
    for got, expected in zip(reused, run_fresh(llama_path, "auto", optimize=False)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_graph_runs_compiled_from_its_second_run_with_the_same_results_and_releases():
    import weakref

    graph, seen = Graph(), []

    def remember(t):
        seen.append(weakref.ref(t))
        return t * 2

    x = graph.record(lambda values: torch.as_tensor(values, dtype=torch.float32), Slot("inputs"))
    doubled = graph.record(remember, x)
    total = graph.record(torch.add, doubled, 1.0)
    alive_at_end = graph.record(lambda t: [ref() is not None for ref in seen], total)  # after doubled's last reader
    for step in range(3):
        graph.bindings = {"inputs": np.arange(4) + step}
        got, alive = graph.compute(total, alive_at_end)
        assert torch.equal(got, torch.arange(4, dtype=torch.float32) * 2 + 2 * step + 1)
        assert alive[-1] is False  # the intermediate was freed once read, interpreted or compiled
    assert graph._plan._compiled is not None and graph._plan.runs == 3
    graph.record(torch.neg, total)  # recording more makes a new plan, interpreted first
    graph.compute(total)
    assert graph._plan.runs == 1 and graph._plan._compiled is None


@pytest.mark.parametrize("int8_hardware", [True, False], ids=["vnni", "no-vnni"])
def test_int8_prompt_rows_are_batch_invariant_with_or_without_int8_hardware(monkeypatch, int8_hardware):
    # Without VNNI, torch._int_mm is far slower than the row kernel, so prompt rows take the row kernel.
    monkeypatch.setattr(torch_native, "takes_int8_rows", lambda codes: False)
    monkeypatch.setattr(torch_native, "int8_products_are_fast", lambda: int8_hardware)
    gen = torch.Generator().manual_seed(0)
    weight = torch_weights.Int8Weight(
        torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=gen), (torch.rand(48, generator=gen) / 100).bfloat16()
    )
    x = torch.randn(40, 64, generator=gen)
    prompt = weight.matmul(x)  # one run of 40 rows: a prompt chunk
    alone = torch.cat([weight.matmul(x[i : i + 1]) for i in range(len(x))])
    reference = x @ weight.dequantized().t()
    assert torch.allclose(prompt.float(), reference, rtol=0.02, atol=0.02)
    if not int8_hardware:
        assert torch.equal(prompt, alone)  # the row kernel for every row


@pytest.mark.skipif(not torch_native.has("int8_rows_matmul"), reason="no native int8_rows_matmul build for this CPU")
@pytest.mark.parametrize("int8_hardware", [True, False], ids=["vnni", "no-vnni"])
def test_int8_prompt_rows_take_int_mm_only_with_int8_hardware_where_the_native_kernel_builds(monkeypatch, int8_hardware):
    # Without VNNI, torch._int_mm is ~30x slower than the native row kernel, which then takes prompt rows too.
    monkeypatch.setattr(torch_native, "int8_products_are_fast", lambda: int8_hardware)
    gen = torch.Generator().manual_seed(1)
    weight = torch_weights.Int8Weight(
        torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=gen), (torch.rand(48, generator=gen) / 100).bfloat16()
    )
    x = torch.randn(40, 64, generator=gen)
    prompt = weight.matmul(x, [(0, 40)])  # one run of 40 rows: a prompt chunk
    assert prompt.dtype == torch.float32
    rows = torch_native.int8_rows_matmul(x, weight.codes, weight.scales)
    two_levels = torch_native.int8_prompt_matmul(x, weight.codes, weight.scales)
    assert not torch.equal(rows, two_levels)  # the two paths round differently: the test tells them apart
    assert torch.equal(prompt, two_levels if int8_hardware else rows)
