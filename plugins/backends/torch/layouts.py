"""How the torch backend holds a weight, and the one matmul each layout runs.

Every layout's `matmul(x, runs)` takes activations [rows, in] and the batch's per-sequence row
runs, and returns [rows, out] (float32; bf16 straight from torch's int kernels: the next op
promotes it or, being another int kernel, takes it as is) whose every row has the same bits
whatever else is in the batch (batch invariance, see the package docstring):

* `Int4Blocks`  Q4_0/Q4_1/Q4_K linears, 4-bit through the native kernel (int16 activations, exact
                integer products; native.py), every row alone, prompt or decode.
* `Int4Weight`  the same through torch's packed int4 kernel (bf16 activations) where there is no
                native kernel, or on CUDA.
* `Int8Weight`  other quantized linears (Q5_x, Q6_K, Q8_0, ...): one int8 per weight and one scale
                per output row (a quarter of float32's bytes, which is what decode reads per token),
                through the native int8 kernel or `_weight_int8pack_mm`. Long prompt runs multiply
                int8 by int8 (`_int_mm`) where the CPU has VNNI; elsewhere the row kernel takes them.
* `DenseWeight` float weights (F32/F16/BF16 files, the reference precision, CUDA).
* `MappedRows`  embeddings: rows dequantized exactly from the file's memory map when looked up, so
                a 262k-row table costs no resident memory.
* `RescoredLogits` the vocabulary projection: all logits from a 4-bit copy (8-bit where the int4
                kernel cannot take the shape), then each row's top candidates recomputed exactly
                from the file. The copy is off by up to ~4 logits, but the true best token ranked
                within its top 4 on every reference step, so argmax, top-k sampling and the
                reported logprobs see exact values; only the far tail stays approximate.
                With the native kernels the copy is an `Int4Columns`: laid out by output row, for
                ranking several rows (concurrent streams' decode tokens) at once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from corral.plugins.backends.torch import native
from corral.plugins.backends.torch.dequantize import INT4_GROUP, SLAB_ELEMENTS, dequantize
from corral.plugins.backends.torch.graph import WholeSequence
from corral.plugins.backends.torch.int4_packing import pack_int4_codes_for_cpu, scales_and_zeros
from corral.topk import topk

Runs = Sequence[tuple[int, int]] | WholeSequence | None

# Dense BLAS picks its algorithm by the row count, so single rows (decode tokens, selected
# outputs) always go in calls of exactly this many rows, padded with copies of the last: a row's
# bits then depend neither on how many others there are nor where it sits. MKL on AMD gave the
# same bits for 2..8 rows; on an Intel Xeon (AVX-512, AMX) a row changes from 3 rows on at some
# shapes (64 x 100, 128 x 256), while at a fixed count its position never mattered.
SINGLES_CHUNK = 8
# A run of at least this many rows of one sequence (a prompt chunk) takes a layout's prompt path
# (float32 BLAS on the file's weights for int4, int8 x int8 products for int8): a row costs the
# decode kernels the same whatever the batch, the prompt paths far less from 64 rows on
# (measured: BENCHMARKS.md, Measurements behind code decisions).
LONG_RUN_ROWS = 32
# Logits recomputed exactly per row: more than the default top_k (40), so top-k sampling draws from
# exact values; of the true top 40, the 4-bit copy's top 128 missed none on the reference prompts.
RESCORE_TOP = 128


def _rows_or_all(runs: Runs, rows: int) -> list[tuple[int, int]]:
    if isinstance(runs, WholeSequence):
        return [(0, rows)]
    if runs is None or sum(stop - start for start, stop in runs) != rows:
        return [(i, i + 1) for i in range(rows)]
    return list(runs)


@attrs.frozen
class DenseWeight:
    """A float weight [out, in] (float32 on CPU, bf16 on CUDA)."""

    weight: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def matmul(self, x: torch.Tensor, runs: Runs) -> torch.Tensor:
        # A multi-row run of one sequence (a prompt chunk) gets a call of its own; single rows
        # (decode tokens, selected outputs) go in chunks of 2..8.
        w = self.weight
        xd = x.to(w.dtype)
        runs = _rows_or_all(runs, x.shape[0])
        if len(runs) == 1 and runs[0][1] - runs[0][0] > 1:
            return F.linear(xd, w).float()
        out = xd.new_empty((x.shape[0], w.shape[0]))
        singles = [start for start, stop in runs if stop - start == 1]
        for start, stop in runs:
            if stop - start > 1:
                out[start:stop] = F.linear(xd[start:stop], w)
        for i in range(0, len(singles), SINGLES_CHUNK):
            rows = singles[i : i + SINGLES_CHUNK]
            padded = rows + rows[-1:] * (SINGLES_CHUNK - len(rows))
            out[rows] = F.linear(xd[padded], w)[: len(rows)]
        return out.float()


@attrs.frozen
class Int4Weight:
    """A linear weight kept 4-bit: torch's packed int4 layout plus per-group scales and zeros."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int
    in_features: int

    source: MappedRows | None = None  # the file's exact weights, for prompt chunks on CPU

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def matmul(self, x: torch.Tensor, runs: Runs = None) -> torch.Tensor:
        if self.source is None:
            return self._kernel(x)
        return _long_runs(x, runs, self._kernel, self._exact_rows)

    def _exact_rows(self, runs: list[torch.Tensor]) -> list[torch.Tensor]:
        return _exact_rows(self.source, runs)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel computes each row on its own: exact under batching as it is.
        xb = x.to(torch.bfloat16)
        group = INT4_GROUP
        if xb.device.type == "cuda":
            return torch._weight_int4pack_mm(xb, self.packed, group, self.scales_and_zeros)
        # torch's direct bindings: less overhead a call than torch.ops.aten's Python dispatch
        # (measured: BENCHMARKS.md, Measurements behind code decisions)
        return torch._weight_int4pack_mm_for_cpu(xb, self.packed, group, self.scales_and_zeros)


def _exact_rows(source: Any, runs: list[torch.Tensor]) -> list[torch.Tensor]:
    weight = source.dequantized()  # the file's exact weights as float32, once per call
    return [F.linear(rows.float(), weight) for rows in runs]


@attrs.frozen
class Int4Blocks:
    """A linear weight kept 4-bit for the native kernel (native/int4_blocks.c): codes in the order
    that kernel reads (`pack`), a scale and min per group of 32 (float16 where exact, else float32), int16
    activations, float32 out. Every row, prompt or decode, goes through the kernel: it computes
    each row alone, and at 512 rows it is faster than float32 BLAS on the dequantized weight, even
    before BLAS's dequantization (measured: BENCHMARKS.md, Measurements behind code decisions)."""

    codes: torch.Tensor  # uint8 [out, in // 2]
    scales: torch.Tensor  # [out, in // 32]
    mins: torch.Tensor  # [out // 16, in // 32, 16]: each 16 rows' mins transposed; the scales' dtype

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Blocks:
        """Codes uint8 [out, in] (0..15), scales and mins [out, in // 32]: w = q * scale + min."""
        return cls.from_packed(cls.pack(codes), scales, mins)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Blocks:
        """Packed codes (`pack`), scales and mins [out, in // 32]. Both float16 where every value is
        exact in it (Q4_0's and Q4_1's are float16 in the file): a sixth fewer bytes to read a token."""
        half = exact_in(scales, torch.float16) and exact_in(mins, torch.float16)
        dtype = torch.float16 if half else torch.float32
        return cls(packed, scales.to(dtype).contiguous(), cls.group(mins).to(dtype))

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """Codes [out, in] -> bytes [out, in // 2] in the order the loaded int4 kernel reads (native/int4_blocks.c).

        AVX2: per block of 32, elements j and 16 + j share byte j (ggml's order). AVX-512: per chunk
        of 4 blocks, a first half of elements 0-7 of each block with 16-23 in the high nibbles, then
        a second half of 8-15 with 24-31 (a 2-block tail chunk likewise)."""
        rows, cols = codes.shape
        if native.loaded_variant("int4_blocks") != "avx512":
            halves = codes.view(rows, cols // 32, 2, 16)
            return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)
        whole = cols // 128 * 128
        parts = [Int4Blocks._chunk(codes[:, :whole], 4)] if whole else []
        if cols > whole:  # a 64-element tail: a chunk of 2 blocks
            parts.append(Int4Blocks._chunk(codes[:, whole:], 2))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    @staticmethod
    def _chunk(codes: torch.Tensor, blocks: int) -> torch.Tensor:
        """Codes [out, 32 * blocks * chunks] -> bytes [out, 16 * blocks * chunks], chunks of `blocks` blocks."""
        rows, cols = codes.shape
        b = codes.reshape(rows, cols // (32 * blocks), blocks, 32)
        first = (b[..., 0:8] | (b[..., 16:24] << 4)).reshape(rows, -1, 8 * blocks)
        second = (b[..., 8:16] | (b[..., 24:32] << 4)).reshape(rows, -1, 8 * blocks)
        return torch.cat((first, second), dim=2).reshape(rows, cols // 2)

    @staticmethod
    def group(mins: torch.Tensor) -> torch.Tensor:
        """Mins [out, in // 32] -> [out // 16, in // 32, 16]."""
        rows, groups = mins.shape
        return mins.float().reshape(rows // 16, 16, groups).transpose(1, 2).contiguous()

    @staticmethod
    def takes(rows: int, cols: int) -> bool:
        return native.has("int4_blocks_matmul") and rows % 16 == 0 and cols % 64 == 0

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    def matmul(self, x: torch.Tensor, runs: Runs = None) -> torch.Tensor:
        return self._kernel(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native.int4_blocks_matmul(x, self.codes, self.scales, self.mins)

    def normed_matmul(self, x: torch.Tensor, norm: torch.Tensor, eps: float, runs: Runs = None) -> torch.Tensor:
        """`matmul(native.rms_norm(x, norm, eps))` in one native call, the same bits."""
        if not native.has("int4_blocks_normed"):
            return self.matmul(native.rms_norm(x, norm, eps), runs)
        return native.int4_blocks_normed(x, norm, eps, self.codes, self.scales, self.mins)

    def added_matmul(self, x: torch.Tensor, residual: torch.Tensor, runs: Runs = None, norm: Any = None, eps: float = 0.0) -> torch.Tensor:
        """`residual + matmul(x)`, or `residual + native.rms_norm(matmul(x), norm, eps)`, in one native call: the same bits."""
        if not (native.has("int4_blocks_added") and native.takes_residual(residual, x.shape[0], self.out_features, norm)):
            return added(residual, self.matmul(x, runs), norm, eps)
        return native.int4_blocks_added(x, self.codes, self.scales, self.mins, residual, norm, eps)

    def bind_normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> Callable | None:
        """`normed_matmul` of rows like x as `call(x)`, for a replayed plan (graph.Plan, native.BoundCall)."""
        if not (native.has("int4_blocks_normed") and native.plain_rows(x) and norm.numel() == x.shape[1]):
            return None
        out, bound = native.bind_int4_blocks(x, self.codes, self.scales, norm, eps)

        def call(x: torch.Tensor) -> torch.Tensor:
            if bound(x.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(), self.mins.data_ptr()):
                raise MemoryError("native int4 kernel could not allocate its normed rows")
            return out

        return call

    def bind_added(self, x: torch.Tensor, residual: torch.Tensor, norm: Any = None, eps: float = 0.0) -> Callable | None:
        """`added_matmul` of rows like x as `call(x, residual)`, for a replayed plan (graph.Plan)."""
        rows = x.shape[0]
        if not (native.has("int4_blocks_added") and native.plain_rows(x) and native.takes_residual(residual, rows, self.out_features, norm)):
            return None
        out, bound = native.bind_int4_blocks(x, self.codes, self.scales, norm, eps, added=True)

        def call(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            if bound(x.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(), self.mins.data_ptr(), residual.data_ptr()):
                raise MemoryError("native int4 kernel could not allocate its product")
            return out

        return call


@attrs.frozen
class Int4Columns:
    """The vocabulary projection's 4-bit copy laid out for ranking several rows at once
    (native/int4_columns.c): each group of 16 output rows' codes interleaved so that one int8
    multiply-add serves all 16, a scale and min per 32 weights. Only coarse products: where
    Int4Blocks' kernel (and its coarse mode, which this replaced) converts and scales every 128
    products of every row, this does it once per 32 products for 16 outputs (measured:
    BENCHMARKS.md, "The vocabulary projection at several rows"). AVX-512 and AVX2 kernels read the
    same layout; where neither builds, the copy is torch's int4 (Int4Weight)."""

    codes: torch.Tensor  # uint8 [out // 16, 8 * in]: per group, per block of 32, 4 quarters of 64 bytes
    scales: torch.Tensor  # [out // 16, in // 32, 16], float16 where exact, else float32
    mins: torch.Tensor  # the same layout and dtype

    @staticmethod
    def takes(rows: int, cols: int) -> bool:
        return native.has("int4_columns_coarse") and rows % 16 == 0 and cols % 32 == 0

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Columns:
        """Codes uint8 [out, in] (0..15), scales and mins [out, in // 32]: w = q * scale + min."""
        return cls.from_packed(cls.pack(codes), scales, mins)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Columns:
        """Packed codes (`pack`), scales and mins [out, in // 32], kept float16 where every value is exact in it."""
        dtype = torch.float16 if exact_in(scales, torch.float16) and exact_in(mins, torch.float16) else torch.float32
        return cls(packed, Int4Blocks.group(scales).to(dtype), Int4Blocks.group(mins).to(dtype))

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """Codes [out, in] -> bytes [out // 16, 8 * in]: for group g, block b, quarter h, byte 4i + j
        holds row 16g + i's element 8h + j (low nibble) and 8h + 4 + j (high nibble)."""
        rows, cols = codes.shape
        c = codes.reshape(rows // 16, 16, cols // 32, 4, 2, 4)  # group, row, block, quarter, nibble, element
        pairs = c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)  # [group, row, block, quarter, element]
        return pairs.permute(0, 2, 3, 1, 4).reshape(rows // 16, cols * 8).contiguous()

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * 16

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // 8

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    def coarse(self, x: torch.Tensor) -> torch.Tensor:
        """Products with int8 activations (a scale per 32), for ranking candidates."""
        return native.int4_columns_coarse(x, self.codes, self.scales, self.mins)


def _long_runs(x: torch.Tensor, runs: Runs, kernel: Any, long_kernel: Any, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Runs of LONG_RUN_ROWS rows or more through `long_kernel` (all of them in one call), the other
    rows through the row-exact `kernel`. A run's length depends only on its own sequence's prompt
    chunking, so which path a row takes never depends on the batch."""
    if x.shape[0] < LONG_RUN_ROWS:  # no run can be long: the decode path, kept short
        return kernel(x)
    runs = _rows_or_all(runs, x.shape[0])
    long = [(start, stop) for start, stop in runs if stop - start >= LONG_RUN_ROWS]
    if not long:
        return kernel(x)
    results = long_kernel([x[start:stop] for start, stop in long])
    # The kernel's dtype out: the dtype flowing on must not depend on what shares the batch.
    if len(long) == 1 and long[0] == (0, x.shape[0]):  # one prompt chunk: its result as it is
        return results[0].to(dtype)
    out = x.new_empty((x.shape[0], results[0].shape[1]), dtype=dtype)
    for (start, stop), result in zip(long, results):
        out[start:stop] = result
    short = [i for start, stop in runs if stop - start < LONG_RUN_ROWS for i in range(start, stop)]
    if short:
        out[short] = kernel(x[short])
    return out


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times (codes [out, in] int8 * scales [out])^T, float32, through `torch._int_mm`
    (int8 x int8 -> int32 with VNNI, well above float32 BLAS's rate at 512 rows;
    measured: BENCHMARKS.md, Measurements behind code decisions).

    Each row of x is quantized in two levels, x ~ s1 * q1 + s2 * q2, the second rounding what the
    first left over: the activation error is ~1/32000 of the row's largest value (bf16 rounding
    is ~1/256 of each value), so the weights' own int8 rounding is what remains. Integer products
    are exact and every row is quantized alone, so a row's result never depends on the others.
    """
    q, s1, s2 = _two_levels(x.float())
    y = torch._int_mm(q, codes.t())  # [2 * rows, out]; K * 127 * 127 fits int32 for K < 133000
    rows = x.shape[0]
    return torch.addcmul(y[:rows] * s1, y[rows:], s2).mul_(scales.float())


def _two_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: int8 codes of x and of what they leave (stacked [2 * rows, in]) and the two scales [rows, 1]."""
    tiny = torch.finfo(torch.float32).tiny
    s1 = x.abs().amax(dim=-1, keepdim=True).clamp_min_(tiny).div_(127)
    q1 = torch.round(x / s1)
    rest = torch.addcmul(x, q1, s1, value=-1)
    s2 = rest.abs().amax(dim=-1, keepdim=True).clamp_min_(tiny).div_(127)
    q2 = torch.round(rest.div_(s2))
    return torch.cat((q1, q2)).to(torch.int8), s1, s2


def requantized_int4(raw: torch.Tensor, qtype: Any, cols: int, columns: bool = False) -> Int4Columns | Int4Blocks | Int4Weight:
    """A GGUF tensor of any type rounded to int4 groups of 32, a slab of rows at a time: for the
    native kernel where it takes the shape (scales and mins exact in float16), else for torch's.
    `columns`: the vocabulary projection's ranking copy, an Int4Columns where its kernel takes the shape."""
    rows = raw.shape[0]
    columns = columns and Int4Columns.takes(rows, cols)
    blocks = not columns and Int4Blocks.takes(rows, cols)
    dtype = torch.float16 if blocks or columns else torch.float32
    packed = torch.empty(rows // 16, cols * 8, dtype=torch.uint8) if columns else torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // INT4_GROUP)
    mins = torch.empty_like(scales)
    step = max(64, SLAB_ELEMENTS // cols // 64 * 64)  # whole packing blocks per slab
    for start in range(0, rows, step):
        codes, scales[start : start + step], mins[start : start + step] = int4_requantize(
            dequantize(raw[start : start + step], qtype, cols), dtype
        )
        if columns:
            packed[start // 16 : (start + step) // 16] = Int4Columns.pack(codes)
        elif blocks:
            packed[start : start + step] = Int4Blocks.pack(codes)
        else:
            packed[start : start + step] = pack_int4_codes_for_cpu(codes)
    if columns:  # float16 unless some group's values lie beyond its range
        return Int4Columns.from_packed(packed, scales, mins)
    if blocks:
        return Int4Blocks.from_packed(packed, scales, mins)
    sz = scales_and_zeros(scales, mins + 8 * scales, torch.bfloat16)
    return Int4Weight(packed, sz, rows, cols)


def int4_requantize(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [rows, cols] rounded to int4 per group of 32 (min to max in 15 steps):
    (codes uint8 [rows, cols], scales, mins [rows, cols // 32], float32 values exact in `dtype`).
    Lossy, unlike dequantize.int4_blocks."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    if dtype != torch.float32:  # a step no smaller and a min no larger: the codes still span each group
        near_scales, near_low = rounded(scales, dtype, up=True), rounded(low, dtype, up=False)
        fits = near_scales.isfinite() & near_low.isfinite()  # groups beyond dtype's range stay float32
        scales, low = torch.where(fits, near_scales, scales), torch.where(fits, near_low, low)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), scales, low


def rounded(values: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Each float32 value rounded to the nearest `dtype` value at least (up) or at most it, as float32."""
    near = values.to(dtype)
    off = near.float() < values if up else near.float() > values
    toward = torch.full_like(near, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(near, toward), near).float()


def added(residual: torch.Tensor, y: torch.Tensor, norm: Any, eps: float) -> torch.Tensor:
    """residual + y, or residual + native.rms_norm(y, norm, eps): what the `added_matmul` kernels compute."""
    return residual + (y if norm is None else native.rms_norm(y, norm, eps))


def exact_in(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value survives a round trip through `dtype` (finite and unrounded)."""
    return torch.equal(values.to(dtype).float(), values.float())


@attrs.frozen
class Int8Weight:
    """w = q * scale[row]: int8 codes [out, in] and a bf16 scale per output row."""

    codes: torch.Tensor
    scales: torch.Tensor  # bf16 [out], the dtype the kernel takes with bf16 activations

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Round a float weight to int8 per output row; the scale is chosen exact in bf16."""
        amax = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        scales = rounded(amax / 127, torch.bfloat16, up=True).to(torch.bfloat16)  # |w| / scale never exceeds 127
        codes = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, qtype: Any, cols: int) -> Int8Weight:
        """Quantize a GGUF tensor's bytes [rows, row_bytes] a slab of rows at a time (never all of it as float32)."""
        rows = raw.shape[0]
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.bfloat16)
        step = max(1, SLAB_ELEMENTS // cols)
        for start in range(0, rows, step):
            part = cls.quantize(dequantize(raw[start : start + step], qtype, cols))
            codes[start : start + step], scales[start : start + step] = part.codes, part.scales
        return cls(codes, scales)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor, runs: Runs = None) -> torch.Tensor:
        # Prompt chunks take torch._int_mm only where the CPU multiplies int8 in hardware (VNNI):
        # without it _int_mm is ~30x slower than the row kernels, native or torch's (measured:
        # BENCHMARKS.md, Measurements behind code decisions), which then take prompt rows too.
        if not native.int8_products_are_fast():
            return self._kernel(x)
        out_dtype = torch.float32 if native.takes_int8_rows(self.codes) else torch.bfloat16
        return _long_runs(x, runs, self._kernel, self._int8_rows, out_dtype)

    def normed_matmul(self, x: torch.Tensor, norm: torch.Tensor, eps: float, runs: Runs = None) -> torch.Tensor:
        """`matmul(native.rms_norm(x, norm, eps))`, in one native call where `matmul` takes the row kernel: the same bits."""
        row_kernel = x.shape[0] == 1 or not native.int8_products_are_fast()
        if row_kernel and native.takes_int8_rows(self.codes) and native.has("int8_rows_normed"):
            return native.int8_rows_normed(x, norm, eps, self.codes, self.scales)
        return self.matmul(native.rms_norm(x, norm, eps), runs)

    def added_matmul(self, x: torch.Tensor, residual: torch.Tensor, runs: Runs = None, norm: Any = None, eps: float = 0.0) -> torch.Tensor:
        """`residual + matmul(x)`, or `residual + native.rms_norm(matmul(x), norm, eps)`, in one native
        call where `matmul` takes the row kernel: the same bits."""
        row_kernel = x.shape[0] == 1 or not native.int8_products_are_fast()
        takes = native.takes_int8_rows(self.codes) and native.has("int8_rows_added")
        if row_kernel and takes and native.takes_residual(residual, x.shape[0], self.out_features, norm):
            return native.int8_rows_added(x, self.codes, self.scales, residual, norm, eps)
        return added(residual, self.matmul(x, runs), norm, eps)

    def bind_normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> Callable | None:
        """`normed_matmul` of rows like x as `call(x)` where it takes one native call, for a replayed plan (graph.Plan)."""
        row_kernel = x.shape[0] == 1 or not native.int8_products_are_fast()
        takes = native.takes_int8_rows(self.codes) and native.has("int8_rows_normed")
        if not (row_kernel and takes and native.plain_rows(x) and norm.numel() == x.shape[1]):
            return None
        out, bound = native.bind_int8_rows(x, self.codes, norm, eps)

        def call(x: torch.Tensor) -> torch.Tensor:
            if bound(x.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr()):
                raise MemoryError("native int8 kernel could not allocate its normed rows")
            return out

        return call

    def bind_added(self, x: torch.Tensor, residual: torch.Tensor, norm: Any = None, eps: float = 0.0) -> Callable | None:
        """`added_matmul` of rows like x as `call(x, residual)` where it takes one native call (graph.Plan)."""
        rows = x.shape[0]
        row_kernel = rows == 1 or not native.int8_products_are_fast()
        takes = native.takes_int8_rows(self.codes) and native.has("int8_rows_added")
        if not (row_kernel and takes and native.plain_rows(x) and native.takes_residual(residual, rows, self.out_features, norm)):
            return None
        out, bound = native.bind_int8_rows(x, self.codes, norm, eps, added=True)

        def call(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            if bound(x.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(), residual.data_ptr()):
                raise MemoryError("native int8 kernel could not allocate its product")
            return out

        return call

    def _int8_rows(self, runs: list[torch.Tensor]) -> list[torch.Tensor]:
        # Prompt chunks: int8 x int8 products, faster than dequantizing for float32 BLAS
        # (measured: BENCHMARKS.md, Measurements behind code decisions).
        # Exact integer products of rows quantized alone: all runs in one call, the same bits.
        matmul = native.int8_prompt_matmul if native.takes_int8_rows(self.codes) else int8_matmul
        if len(runs) == 1:
            return [matmul(runs[0], self.codes, self.scales)]
        return list(matmul(torch.cat(runs), self.codes, self.scales).split([len(rows) for rows in runs]))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        # Row-exact: every row is computed alone, whatever the batch.
        if native.takes_int8_rows(self.codes):
            return native.int8_rows_matmul(x, self.codes, self.scales)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)


@attrs.frozen
class MappedRows:
    """A table read straight from the GGUF file's bytes [rows, row_bytes]; rows dequantize on use."""

    raw: torch.Tensor  # uint8 over the file's read-only memory map; never written
    qtype: Any
    cols: int

    @property
    def nbytes(self) -> int:
        return 0  # file-backed pages, loaded by the kernel on first touch and shared

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    def dequantized(self) -> torch.Tensor:
        """The whole table as float32 [rows, cols]."""
        return dequantize(self.raw, self.qtype, self.cols)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), cols], exact."""
        return dequantize(self.raw.index_select(0, ids.reshape(-1).cpu()), self.qtype, self.cols).to(ids.device)


@attrs.frozen
class RescoredLogits:
    """The vocabulary projection: approximate logits, then each row's top candidates recomputed exactly."""

    approx: Int4Columns | Int4Blocks | Int4Weight | Int8Weight
    exact: MappedRows

    @property
    def nbytes(self) -> int:
        return self.approx.nbytes

    def approximate(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits that rank the candidates and stand for the unlikely rest. Coarse int8
        activations move them by about a tenth of what the 4-bit weights already do."""
        return self.approx.coarse(x) if isinstance(self.approx, Int4Columns) else self.approx._kernel(x).float()

    def matmul(self, x: torch.Tensor, runs: Runs = None) -> torch.Tensor:
        logits = self.approximate(x)
        if not len(x):
            return logits
        top = _top_ids(logits, min(RESCORE_TOP, logits.shape[1]))  # [rows, k]
        weights = self.exact.rows(top).view(*top.shape, self.exact.cols)  # [rows, k, in]
        # A product and a sum over `in` per candidate: the same bits whatever the batch.
        logits.scatter_(1, top, (weights * x.float()[:, None, :]).sum(-1))
        return logits


def _top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest logits: one native pass over each row where it runs
    (measured: BENCHMARKS.md, "The vocabulary projection at several rows"), else corral.topk."""
    if native.takes_topk_rows(logits, k):
        return native.topk_rows(logits, k)[1]
    return topk(logits, k)[1]
