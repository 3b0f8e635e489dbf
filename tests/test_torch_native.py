"""The torch backend's native CPU kernels (torch_native.py, native/*.c): built here, against float64
references, batch-invariant bit for bit, and replaced by torch's kernels where they cannot be built."""

from __future__ import annotations

import logging
import platform
import shutil
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_torch_quant import INT4, cols_of, random_raw, reference

from corral.plugins.backends.torch import attention as torch_attention, dequantize as torch_quant, kv_cells, native as torch_native
from corral.plugins.backends.torch import TorchBackend
from corral.plugins.backends.torch.fusion import stack_weights
from corral.plugins.backends.torch.layouts import Int4Blocks, Int4Columns, Int4Weight, Int8Weight, requantized_int4

Q = gguf.GGMLQuantizationType


def _cpu_has(*flags: str) -> bool:
    try:
        features = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return platform.machine() == "x86_64" and set(flags) <= features and shutil.which("cc") is not None


def needs_native(kernel: str):
    """Skips a test where the native `kernel` is not built here (no compiler, neither AVX-512 nor AVX2, no such variant)."""
    return pytest.mark.skipif(not torch_native.has(kernel), reason=f"no native {kernel} build for this CPU")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """torch_native with its caches cleared (and cleared again afterwards), kernels built into tmp_path."""
    monkeypatch.setenv("CORRAL_KERNELS", str(tmp_path / "kernels"))
    torch_native.load.cache_clear()
    torch_native.function.cache_clear()
    yield tmp_path / "kernels"
    monkeypatch.undo()
    torch_native.load.cache_clear()
    torch_native.function.cache_clear()


# --- the build --------------------------------------------------------------------------------------
@pytest.mark.slow  # compiles the kernels
def test_every_kernel_builds_on_an_avx512_machine_with_a_compiler(fresh_native):
    if not _cpu_has("avx512f", "avx512bw"):
        pytest.skip("not an AVX-512 machine with cc")
    assert torch_native.variant() == "avx512"
    assert all(torch_native.has(name) for name in torch_native.SIGNATURES)
    built = sorted(path.name for path in fresh_native.iterdir())
    assert len(built) == len({source for source, _ in torch_native.SIGNATURES.values()})
    assert all(name.endswith(".so") for name in built)


def test_disabled_native_kernels_leave_torchs_layouts(fresh_native, monkeypatch):
    monkeypatch.setenv("CORRAL_NATIVE_KERNELS", "0")
    assert torch_native.load("int4_blocks") is None and not torch_native.has("rms_norm")
    assert not Int4Blocks.takes(64, 64)
    raw = torch.from_numpy(random_raw(Q.Q4_0, rows=64, blocks_per_row=2))
    assert type(requantized_int4(raw, Q.Q4_0, 64)) is Int4Weight
    assert not fresh_native.exists()  # nothing was compiled


def test_a_failing_compiler_falls_back_to_torch_with_a_warning(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # exits 1 whatever it is given
    monkeypatch.setattr(torch_native, "_cpu_features", lambda: "flags\t\t: fpu avx2 avx512f avx512bw")
    with caplog.at_level(logging.WARNING, logger="corral.plugins.backends.torch.native"):
        assert torch_native.function("rms_norm") is None
    assert "not built" in caplog.text


@pytest.mark.slow  # compiles the kernels
def test_the_avx2_kernels_build_on_an_avx2_machine_without_avx512(fresh_native):
    if not _cpu_has("avx2", "fma", "f16c") or _cpu_has("avx512f", "avx512bw"):
        pytest.skip("not an AVX2 machine without AVX-512 with cc")
    assert torch_native.variant() == "avx2"
    ported = {path.stem for path in (torch_native.SOURCE_DIR / "avx2").glob("*.c")}
    assert {"int4_blocks", "int8_rows", "rms_norm", "gated", "row_attention"} <= ported
    ported |= {path.stem for path in torch_native.COMMON_DIR.glob("*.c")}  # plain C: every variant builds them
    assert "rope" in ported
    assert all(torch_native.has(name) == (source in ported) for name, (source, _) in torch_native.SIGNATURES.items())
    assert sorted(path.name.split("-")[0] for path in fresh_native.iterdir()) == sorted(ported)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("fpu avx2 fma f16c avx512f avx512bw", "avx512"), ("fpu avx2 fma f16c avx512f", "avx2"), ("fpu avx2 fma f16c", "avx2")],
)
def test_the_variant_is_the_best_the_cpu_has(monkeypatch, flags, expected):
    monkeypatch.setattr(torch_native, "_cpu_features", lambda: f"flags\t\t: {flags}")
    assert torch_native.variant() == expected


def test_without_avx512_or_avx2_no_compile_is_tried(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a compile attempt would fail with a warning
    monkeypatch.setattr(torch_native, "_cpu_features", lambda: "flags\t\t: fpu sse2 avx fma")
    with caplog.at_level(logging.INFO, logger="corral.plugins.backends.torch.native"):
        assert torch_native.function("rms_norm") is None
    assert "neither AVX-512 nor AVX2" in caplog.text and "not built" not in caplog.text


# --- int4 blocks ------------------------------------------------------------------------------------
def random_blocks(rows: int, cols: int, half: bool, seed: int = 0) -> tuple[Int4Blocks, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    scales = torch.rand(rows, cols // 32, generator=gen) * 0.02
    mins = -torch.rand(rows, cols // 32, generator=gen) * 0.1
    if half:
        scales, mins = scales.half().float(), mins.half().float()
    else:
        scales = scales + 1e-9  # not exact in float16
    weight = (codes.float().view(rows, -1, 32) * scales[..., None] + mins[..., None]).view(rows, cols)
    return Int4Blocks.from_codes(codes, scales, mins), weight


@needs_native("int4_blocks_matmul")
@pytest.mark.parametrize("half", [True, False], ids=["f16", "f32"])
@pytest.mark.parametrize(("rows", "cols"), [(16, 64), (48, 576), (32, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_blocks_matmul_matches_float64(half, rows, cols, dtype):
    layer, weight = random_blocks(rows, cols, half)
    assert layer.scales.dtype == layer.mins.dtype == (torch.float16 if half else torch.float32)
    x = randn(9, cols, seed=1).to(dtype)
    x[:, 3] *= 50  # an outlier feature
    expected = x.double() @ weight.double().T
    got = layer.matmul(x)
    assert got.dtype == torch.float32
    # int16 activations: each off by at most 1/65534 of its row's largest value
    bound = (x.double().abs().amax(1, keepdim=True) / 65534) @ weight.double().abs().sum(1, keepdim=True).T
    assert ((got.double() - expected).abs() <= bound + 1e-5 * expected.abs().max()).all()


@pytest.mark.slow  # compiles the kernels
@pytest.mark.parametrize(("flags", "variant"), [(("avx512f", "avx512bw"), "avx512"), (("avx2", "fma", "f16c"), "avx2")])
def test_int4_codes_are_packed_for_the_variant_whose_kernel_is_loaded(fresh_native, monkeypatch, flags, variant):
    """The AVX-512 kernel reads codes in chunks of 4 blocks, the AVX2 one in ggml's order: each build,
    on a CPU that runs both, gets the codes it reads and the right products (576: a 2-block tail chunk)."""
    if not _cpu_has(*flags):
        pytest.skip(f"this CPU has no {variant}")
    monkeypatch.setattr(torch_native, "_cpu_features", lambda: "flags\t\t: fpu " + " ".join(flags))
    layer, weight = random_blocks(32, 576, half=True)
    assert torch_native.loaded_variant("int4_blocks") == variant
    x = randn(9, 576, seed=1)
    expected = x.double() @ weight.double().T
    bound = (x.double().abs().amax(1, keepdim=True) / 65534) @ weight.double().abs().sum(1, keepdim=True).T
    assert ((layer.matmul(x).double() - expected).abs() <= bound + 1e-5 * expected.abs().max()).all()


@needs_native("int4_blocks_matmul")
def test_int4_blocks_rows_are_the_same_alone_and_batched():
    layer, _ = random_blocks(64, 576, half=True)
    x = randn(11, 576, seed=2)
    batched = layer.matmul(x)
    for i in range(11):
        assert torch.equal(layer.matmul(x[i : i + 1])[0], batched[i])
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer.matmul(x), batched)
    finally:
        torch.set_num_threads(2)


@needs_native("int4_blocks_matmul")
@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_int4_blocks_of_gguf_bytes_hold_the_files_weights(qtype):
    raw = random_raw(qtype, rows=32, blocks_per_row=4 if qtype != Q.Q4_K else 1)
    cols = cols_of(qtype, raw)
    codes, scales, mins = torch_quant.int4_blocks(torch.from_numpy(raw), qtype, cols)
    layer = Int4Blocks.from_codes(codes, scales, mins)
    # Q4_0 and Q4_1 store float16 scales and mins in the file: kept exactly so
    assert layer.scales.dtype == (torch.float32 if qtype == Q.Q4_K else torch.float16)
    exact = reference(qtype, raw)
    rebuilt = codes.float().view(32, -1, 32) * layer.scales.float()[..., None]
    rebuilt += layer.mins.float().transpose(1, 2).reshape(32, -1)[..., None]
    assert torch.allclose(rebuilt.view(32, cols), exact, rtol=0, atol=1e-6 * exact.abs().max().item())
    x = randn(3, cols, seed=3)
    expected = x.double() @ exact.double().T
    assert torch.allclose(layer.matmul(x).double(), expected, rtol=0, atol=2e-4 * expected.abs().max().item())


@needs_native("int4_blocks_matmul")
def test_int4_blocks_prompt_runs_take_the_kernel_row_by_row():
    raw = torch.from_numpy(random_raw(Q.Q4_1, rows=32, blocks_per_row=2))
    layer = Int4Blocks.from_codes(*torch_quant.int4_blocks(raw, Q.Q4_1, 64))
    x = randn(70, 64, seed=4)
    got = layer.matmul(x, [(0, 1), (1, 40), (40, 70)])
    assert torch.equal(got[1:40], layer.matmul(x[1:40], [(0, 39)]))  # a prompt chunk alone
    assert torch.equal(got[:1], layer.matmul(x[:1]))
    expected = x.double() @ reference(Q.Q4_1, raw.numpy()).double().T
    assert torch.allclose(got.double(), expected, rtol=0, atol=2e-4 * expected.abs().max().item())


@needs_native("int4_blocks_matmul")
def test_stacked_int4_blocks_compute_each_part_and_share_their_storage():
    parts = [random_blocks(rows, 128, half=True, seed=i)[0] for i, rows in enumerate((64, 32, 16))]
    x = randn(3, 128, seed=5)
    separate = torch.cat([part.matmul(x) for part in parts], dim=1)
    stacked = stack_weights(parts)
    assert torch.equal(stacked.matmul(x), separate)
    for part in parts:
        assert part.codes.untyped_storage().data_ptr() == stacked.codes.untyped_storage().data_ptr()
    assert stack_weights([parts[0], random_blocks(16, 128, half=False)[0]]) is None  # mixed scale dtypes


@needs_native("int4_blocks_matmul")
def test_requantized_logits_copy_has_float16_scales_spanning_each_group():
    values = np.random.default_rng(6).normal(0, 0.05, (64, 128)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(values, Q.Q8_0))
    layer = requantized_int4(raw, Q.Q8_0, 128)
    assert type(layer) is Int4Blocks and layer.scales.dtype == torch.float16
    exact = torch_quant.dequantize(raw, Q.Q8_0, 128)
    x = randn(2, 128, seed=7)
    expected = x @ exact.T
    assert torch.allclose(layer.matmul(x), expected, rtol=0, atol=0.1 * expected.abs().max().item())


# --- int4 columns (the vocabulary projection's ranking copy) ---------------------------------------
def random_columns(rows: int, cols: int, half: bool, seed: int = 0) -> tuple[Int4Columns, Int4Blocks | None, torch.Tensor]:
    """The same random 4-bit weight as an Int4Columns, an Int4Blocks (None where cols % 64: it takes no odd block) and floats."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    scales, mins = torch.rand(rows, cols // 32, generator=gen) * 0.02, -torch.rand(rows, cols // 32, generator=gen) * 0.1
    scales, mins = (scales.half().float(), mins.half().float()) if half else (scales + 1e-9, mins)
    weight = (codes.float().view(rows, -1, 32) * scales[..., None] + mins[..., None]).view(rows, cols)
    blocks = Int4Blocks.from_codes(codes, scales, mins) if cols % 64 == 0 else None
    return Int4Columns.from_codes(codes, scales, mins), blocks, weight


@needs_native("int4_columns_coarse")
@pytest.mark.parametrize("half", [True, False], ids=["f16", "f32"])
@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (48, 576), (32, 1056)])  # one block; a 64-wide tail; 33 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_columns_coarse_products_are_within_int8_rounding_per_block(half, rows, cols, dtype):
    layer, _, weight = random_columns(rows, cols, half)
    assert layer.scales.dtype == layer.mins.dtype == (torch.float16 if half else torch.float32)
    assert (layer.out_features, layer.in_features) == (rows, cols)
    x = randn(11, cols, seed=4).to(dtype)
    x[:, 3] *= 50  # an outlier coarsens only its own block
    expected = x.double() @ weight.double().T
    got = layer.coarse(x)
    assert got.dtype == torch.float32 and got.shape == (11, rows)
    steps = x.double().view(11, -1, 32).abs().amax(-1) / 254  # half a step of each block's int8 scale
    bound = steps @ weight.double().abs().view(rows, -1, 32).sum(-1).T
    assert ((got.double() - expected).abs() <= bound * 1.0001 + 1e-5 * expected.abs().max()).all()


@needs_native("int4_columns_coarse")
def test_int4_columns_rank_like_the_exact_int4_kernel_and_keep_their_bits_alone_batched_and_threaded():
    layer, blocks, weight = random_columns(64, 640, half=True, seed=3)
    x = randn(19, 640, seed=5)  # past two tiles of 8 rows
    got = layer.coarse(x)
    # against Int4Blocks' int16 products of the same weights: apart by the int8 rounding at most
    steps = x.double().view(19, -1, 32).abs().amax(-1) / 254
    bound = steps @ weight.double().abs().view(64, -1, 32).sum(-1).T
    assert ((got.double() - blocks.matmul(x).double()).abs() <= bound * 1.001 + 1e-4 * got.abs().max().item()).all()
    for i in range(19):
        assert torch.equal(layer.coarse(x[i : i + 1])[0], got[i])
    assert torch.equal(layer.coarse(x[5:13]), got[5:13])
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer.coarse(x), got)
    finally:
        torch.set_num_threads(2)


@pytest.mark.slow  # compiles the kernels
@pytest.mark.parametrize(("flags", "variant"), [(("avx512f", "avx512bw"), "avx512"), (("avx2", "fma", "f16c"), "avx2")])
def test_int4_columns_are_within_int8_rounding_in_each_variant(fresh_native, monkeypatch, flags, variant):
    """Both builds read the same layout: products within the int8 rounding bound, rows alone = batched."""
    if not _cpu_has(*flags):
        pytest.skip(f"this CPU has no {variant}")
    monkeypatch.setattr(torch_native, "_cpu_features", lambda: "flags\t\t: fpu " + " ".join(flags))
    layer, _, weight = random_columns(48, 1056, half=True, seed=9)
    assert torch_native.loaded_variant("int4_columns") == variant
    x = randn(9, 1056, seed=10)
    x[:, 3] *= 50
    got = layer.coarse(x)
    expected = x.double() @ weight.double().T
    bound = (x.double().view(9, -1, 32).abs().amax(-1) / 254) @ weight.double().abs().view(48, -1, 32).sum(-1).T
    assert ((got.double() - expected).abs() <= bound * 1.0001 + 1e-5 * expected.abs().max()).all()
    for i in range(9):
        assert torch.equal(layer.coarse(x[i : i + 1])[0], got[i])


@needs_native("int4_columns_coarse")
def test_the_logits_ranking_copy_is_column_grouped_where_its_kernel_runs():
    values = np.random.default_rng(6).normal(0, 0.05, (64, 128)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(values, Q.Q8_0))
    layer = requantized_int4(raw, Q.Q8_0, 128, columns=True)
    assert type(layer) is Int4Columns and layer.scales.dtype == torch.float16
    blocks = requantized_int4(raw, Q.Q8_0, 128)
    x = randn(3, 128, seed=7)
    assert torch.allclose(layer.coarse(x), blocks.matmul(x), rtol=0, atol=0.02 * blocks.matmul(x).abs().max().item())


# --- top k of rows (the logits' exact candidates) ---------------------------------------------------
@needs_native("topk_rows")
@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 5), (4096, 128), (262144, 128), (300, 300)])
def test_topk_rows_gives_torchs_top_values_largest_first(n, k):
    x = randn(5, n, seed=11)
    values, indices = torch_native.topk_rows(x, k)
    expected = torch.topk(x, k, dim=-1)
    assert torch.equal(values, expected.values)  # no ties in random floats: the same entries, in order
    assert torch.equal(indices, expected.indices) and indices.dtype == torch.int64
    for i in range(5):  # a row's answer is its own
        assert torch.equal(torch_native.topk_rows(x[i : i + 1], k)[1][0], indices[i])


@needs_native("topk_rows")
def test_topk_rows_ranks_ties_by_index_and_nan_last():
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0, 3.0, -float("inf"), 0.5] * 5])
    values, indices = torch_native.topk_rows(x, 6)
    assert indices[0].tolist() == [1, 2, 5, 9, 10, 13]  # of the fifteen 3.0s, the first six by index
    assert values[0].tolist() == [3.0] * 6
    nans = torch.full((2, 40), float("nan"))
    nans[1, 17] = -5.0
    values, indices = torch_native.topk_rows(nans, 3)
    assert indices[0].tolist() == [0, 1, 2] and values[0].tolist() == [-float("inf")] * 3  # every index valid
    assert indices[1, 0].item() == 17 and values[1, 0].item() == -5.0
    assert not torch_native.takes_topk_rows(torch.zeros(2, 4), 5) and not torch_native.takes_topk_rows(torch.zeros(2, 4, dtype=torch.bfloat16), 2)


# --- int8 rows --------------------------------------------------------------------------------------
@needs_native("int8_rows_matmul")
@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (64, 640), (32, 4128)])  # 4128: past a flush of the int32 sums
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_rows_matmul_matches_float64(rows, cols, dtype):
    layer = Int8Weight.quantize(randn(rows, cols, seed=8) * 0.05)
    x = randn(5, cols, seed=9).to(dtype)
    x[:, 1] *= 200
    weight = layer.dequantized().double()
    expected = x.double() @ weight.T
    got = layer.matmul(x)
    assert got.dtype == torch.float32
    bound = (x.double().abs().amax(1, keepdim=True) / 65534) @ weight.abs().sum(1, keepdim=True).T
    assert ((got.double() - expected).abs() <= bound + 1e-5 * expected.abs().max()).all()
    assert torch.equal(torch.cat([layer.matmul(x[i : i + 1]) for i in range(5)]), got)


def avx512_int8_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """native/int8_rows.c's int8_rows_matmul, operation for operation in float32 (both builds promise its bits):
    int16 codes of each row, exact int32 sums in 16 lanes (columns 32i + 2j, 32i + 2j + 1 in lane j) flushed
    to float every 2048 columns, the lanes added in sum16's order, times the row's and the weight's scales."""
    x = x.float()
    top = x.abs().amax(1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(32767.0) / top, torch.zeros(()))
    q = torch.round(x * inverse).long()  # half to even, as vcvtps2dq
    rows, cols = x.shape
    products = q[:, None, :] * codes.long()[None]  # [rows, out, in], exact
    flushes = products.reshape(rows, codes.shape[0], -1, 16, 2).sum(-1)  # [.., in / 32, lane]
    lanes = torch.zeros(rows, codes.shape[0], 16)
    for start in range(0, cols // 32, 64):
        lanes = lanes + flushes[:, :, start : start + 64].sum(2).float()
    quads = [(lanes[..., 4 * c] + lanes[..., 4 * c + 2]) + (lanes[..., 4 * c + 1] + lanes[..., 4 * c + 3]) for c in range(4)]
    total = (quads[0] + quads[2]) + (quads[1] + quads[3])
    return total * (top / 32767.0) * scales.float()


@needs_native("int8_rows_matmul")
@pytest.mark.parametrize("cols", [640, 4128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_rows_matmul_is_the_avx512_arithmetic_bit_for_bit(cols, dtype):
    # The AVX2 build splits each 16-lane register in two: the same integer sums and float additions.
    # Same-signed weights and activations make lane sums past 2^24, where the order of additions
    # shows (a sequential sum of the lanes differs in a third of these outputs).
    weight = randn(32, cols, seed=40)
    weight[:16] = weight[:16].abs() + 1
    layer = Int8Weight.quantize(weight)
    x = randn(6, cols, seed=41)
    x[:3] = x[:3].abs() + 2
    x[:, 5] *= 3
    x[4] = 0
    x = x.to(dtype)
    got = torch_native.int8_rows_matmul(x, layer.codes, layer.scales)
    assert torch.equal(got, avx512_int8_rows(x, layer.codes, layer.scales))


@needs_native("int8_two_levels")
@pytest.mark.parametrize("cols", [640, 77])  # 77: a tail shorter than a register
def test_int8_two_levels_are_the_avx512_roundings(cols):
    x = randn(5, cols, seed=42)
    x[:, 2] *= 100
    x[1] = 0
    codes = torch.empty(10, cols, dtype=torch.int8)
    scales = torch.empty(2, 5)
    torch_native.function("int8_two_levels")(x.data_ptr(), False, 5, cols, codes.data_ptr(), scales.data_ptr(), 2)
    top = x.abs().amax(1, keepdim=True)
    s1, inv1 = top / 127, torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    q1 = torch.round(x * inv1)
    rest = (x.double() - q1.double() * s1.double()).float()  # exact in float64, then rounded once: the kernel's fnmadd
    top2 = rest.abs().amax(1, keepdim=True)
    s2, inv2 = top2 / 127, torch.where(top2 > 0, torch.tensor(127.0) / top2, torch.zeros(()))
    q2 = torch.round(rest * inv2)
    assert torch.equal(codes, torch.cat((q1, q2)).to(torch.int8))
    assert torch.equal(scales, torch.cat((s1.T, s2.T)))


@needs_native("int8_two_levels")
def test_int8_prompt_matmul_matches_float64_and_each_row_alone():
    layer = Int8Weight.quantize(randn(48, 640, seed=43) * 0.05)
    x = randn(40, 640, seed=44)
    x[:, 7] *= 200
    weight = layer.dequantized().double()
    got = torch_native.int8_prompt_matmul(x, layer.codes, layer.scales)
    expected = x.double() @ weight.T
    bound = (x.double().abs().amax(1, keepdim=True) / 16000) @ weight.abs().sum(1, keepdim=True).T  # two levels: ~1/32000
    assert ((got.double() - expected).abs() <= bound + 1e-5 * expected.abs().max()).all()
    for i in (0, 21, 39):
        assert torch.equal(torch_native.int8_prompt_matmul(x[i : i + 1], layer.codes, layer.scales)[0], got[i])


def test_int8_rows_take_only_whole_kernel_tiles():
    assert not torch_native.takes_int8_rows(torch.zeros(8, 64, dtype=torch.int8))
    assert not torch_native.takes_int8_rows(torch.zeros(16, 48, dtype=torch.int8))


# --- rms_norm ---------------------------------------------------------------------------------------
@needs_native("rms_norm")
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: split across threads
@pytest.mark.parametrize("dim", [576, 40, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_torch(rows, dim, dtype):
    x, w = randn(rows, dim, seed=10).to(dtype), randn(dim, seed=11)
    got = torch_native.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x.float(), (dim,), w, 1e-6), rtol=2e-6, atol=2e-6)
    assert torch.equal(torch.cat([torch_native.rms_norm(x[i : i + 1], w, 1e-6) for i in range(rows)]), got)


@needs_native("rms_norm")
def test_rms_norm_of_heads_and_of_a_mismatched_weight():
    x = randn(2, 4, 64, seed=12)[:, 1:]  # a non-contiguous view of heads
    torch.testing.assert_close(torch_native.rms_norm(x, torch.ones(64), 1e-6), F.rms_norm(x, (64,), torch.ones(64), 1e-6))
    with pytest.raises(ValueError, match="64 values for rows of 32"):
        torch_native.rms_norm(randn(2, 32), torch.ones(64), 1e-6)


# --- gated activations -----------------------------------------------------------------------------
@needs_native("gated")
@pytest.mark.parametrize(("activation", "torch_activation"), [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_gated_matches_torch_on_column_slices_and_each_row_alone(activation, torch_activation):
    fused = randn(5, 2 * 1539, seed=33) * 6  # a 1539 width: a tail of 3 lanes
    fused[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = fused[:, :1539], fused[:, 1539:]
    got = torch_native.gated(gate, up, activation)
    torch.testing.assert_close(got, torch_activation(gate) * up, rtol=1e-5, atol=1e-5)  # values up to ~500
    assert torch.equal(torch.cat([torch_native.gated(gate[i : i + 1], up[i : i + 1], activation) for i in range(5)]), got)


# --- row attention ----------------------------------------------------------------------------------
def reference_attention(q, keys, values, group, scale) -> torch.Tensor:
    cells = slice(group.start, group.start + group.used)
    k, v = keys[:, cells].double()[None], values[:, cells].double()[None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[0]  # [heads, dim]


@needs_native("row_attention")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lengths"),
    [(9, 3, 64, [512, 17, 1]), (4, 1, 256, [100, 99]), (8, 8, 32, [16, 15, 33]), (6, 2, 48, [5]), (8, 1, 32, [40, 7]),
     (10, 2, 64, [9, 2]), (12, 1, 16, [21])],  # groups of 1-4 heads (keys two at a time: odd counts too), then 5, 8 and 12 (fewer value tiles)
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_row_attention_matches_float64_and_is_the_same_alone(heads, kv_heads, dim, lengths, dtype):
    region = 600
    keys = randn(kv_heads, region * len(lengths), dim, seed=13).to(dtype)
    values = randn(kv_heads, region * len(lengths), dim, seed=14).to(dtype)
    q = randn(len(lengths), heads, dim, seed=15)
    groups = [types.SimpleNamespace(rows=slice(i, i + 1), start=i * region, used=n, mask=None) for i, n in enumerate(lengths)]
    mask = torch.rand(1, lengths[0], generator=torch.Generator().manual_seed(16)) > 0.3
    mask[0, -1] = True  # a row always sees its own key
    groups[0].mask = mask
    got = torch_native.row_attention(q, keys, values, torch_native.attention_regions(groups, len(lengths)), 0.125)
    assert got.shape == (len(lengths), heads, dim) and got.dtype == torch.float32
    for i, group in enumerate(groups):
        expected = reference_attention(q[i : i + 1], keys, values, group, 0.125)
        assert (got[i].double() - expected).abs().max() < 2e-6
        group.rows = slice(0, 1)
        alone = torch_native.row_attention(q[i : i + 1], keys, values, torch_native.attention_regions([group], 1), 0.125)
        assert torch.equal(alone[0], got[i])


@needs_native("row_attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prompt_rows_attend_each_alone_as_a_decode_row_would(dtype):
    # Batch rows [0, 7) decode-free prompt rows of sequence A (after 5 cached cells, a causal mask
    # with a window of 6), given out of order; row 7 a decode row of sequence B.
    keys, values = randn(2, 64, 32, seed=30).to(dtype), randn(2, 64, 32, seed=31).to(dtype)
    q = randn(8, 6, 32, seed=32)
    positions = torch.arange(12)
    query_positions = torch.arange(5, 12)
    mask = (positions[None] <= query_positions[:, None]) & (query_positions[:, None] - positions[None] < 6)
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    prompt = types.SimpleNamespace(rows=order, start=0, used=12, mask=mask.t().contiguous().t())  # a strided view
    decode = types.SimpleNamespace(rows=slice(7, 8), start=32, used=20, mask=None)
    regions = torch_native.attention_regions([prompt, decode], 8)
    assert regions.array[1, order].tolist() == list(range(6, 13))  # each prompt row reads up to its own cell
    got = torch_native.row_attention(q, keys, values, regions, 0.3)
    for i, row in enumerate(order.tolist()):
        alone = types.SimpleNamespace(rows=slice(0, 1), start=0, used=12, mask=mask[i : i + 1].contiguous())
        expected = reference_attention(q[row : row + 1], keys, values, alone, 0.3)
        assert (got[row].double() - expected).abs().max() < 2e-6
        one = torch_native.row_attention(q[row : row + 1], keys, values, torch_native.attention_regions([alone], 1), 0.3)
        assert torch.equal(one[0], got[row])
    decode.rows = slice(0, 1)
    assert torch.equal(torch_native.row_attention(q[7:], keys, values, torch_native.attention_regions([decode], 1), 0.3)[0], got[7])


@needs_native("row_attention")
def test_row_attention_is_the_same_on_one_thread():
    keys, values = randn(1, 300, 256, seed=17).bfloat16(), randn(1, 300, 256, seed=18).bfloat16()
    q = randn(1, 4, 256, seed=19)  # one kv head: its query heads split across threads
    groups = [types.SimpleNamespace(rows=slice(0, 1), start=0, used=300, mask=None)]
    regions = torch_native.attention_regions(groups, 1)
    two = torch_native.row_attention(q, keys, values, regions, 0.0625)
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch_native.row_attention(q, keys, values, regions, 0.0625), two)
    finally:
        torch.set_num_threads(2)


def test_folded_grouped_heads_attend_like_torchs_grouped_query_path():
    q, keys, values = randn(2, 9, 1, 64, seed=20), randn(2, 3, 40, 64, seed=21), randn(2, 3, 40, 64, seed=22)
    expected = F.scaled_dot_product_attention(q, keys, values, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(torch_attention._sdpa(q, keys, values, None, 0.125, True), expected)


@needs_native("rms_norm")
def test_backend_runs_norms_natively_and_not_on_cuda_shaped_weights():
    backend = TorchBackend(device="cpu")
    assert backend.native("rms_norm")
    ctx = backend.new_context()
    x = ctx.record(lambda: randn(2, 64, seed=23))
    (out,) = ctx.compute(ctx.rms_norm(x, torch.ones(64), 1e-6))
    torch.testing.assert_close(out, F.rms_norm(randn(2, 64, seed=23), (64,), torch.ones(64), 1e-6))
    assert ctx.nodes[-1][0] is torch_native.rms_norm
    ctx.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6)  # not a float32 weight: torch's op
    assert ctx.nodes[-1][0] is not torch_native.rms_norm


@needs_native("row_attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_row_attention_stores_the_new_rows_as_torch_would_first(dtype):
    keys, values = randn(3, 64, 32, seed=24).to(dtype), randn(3, 64, 32, seed=25).to(dtype)
    k, v, q = randn(2, 3, 32, seed=26) * 7, randn(2, 3, 32, seed=27), randn(2, 6, 32, seed=28)
    groups = [
        types.SimpleNamespace(rows=slice(0, 1), start=0, used=20, mask=None),
        types.SimpleNamespace(rows=slice(1, 2), start=32, used=9, mask=None),
    ]
    expected_keys, expected_values = keys.clone(), values.clone()
    kv_cells.write_cells(expected_keys, torch.tensor([19, 40]), k)
    kv_cells.write_cells(expected_values, torch.tensor([19, 40]), v)
    expected = torch_native.row_attention(q, expected_keys, expected_values, torch_native.attention_regions(groups, 2), 0.2)
    fused = randn(2, 3 * 32 * 3, seed=29)  # k and v as column slices of one fused output, as the model has them
    fused[:, 96:192], fused[:, 192:] = k.reshape(2, 96), v.reshape(2, 96)
    k_view, v_view = fused[:, 96:192].view(2, 3, 32), fused[:, 192:].view(2, 3, 32)
    got = torch_native.row_attention(q, keys, values, torch_native.attention_regions(groups, 2, [19, 40]), 0.2, (k_view, v_view))
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # bf16 rounded to nearest even
    assert torch.equal(got, expected)
