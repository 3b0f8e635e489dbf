"""Native CPU kernels of the torch backend: small C files (native/) compiled for this machine.

They fill gaps in torch's CPU kernels: 4-bit and int8 matmuls with exact integer products
(torch's int4 kernel dequantizes every weight to fp32 per group of 4 activation rows), attention
of each query row over its own cells (torch's SDPA is built for blocks of queries), and small
composite ops (rms_norm, gated activations) whose several kernels cost more in dispatch than in
arithmetic at decode sizes. Like torch.compile's C++ backend, they are built on first use with
the system C compiler (`$CC`, else `cc`) for this CPU (`-march=native`), cached under
`$CORRAL_KERNELS` (default `~/.cache/corral/kernels`) by a hash of the source, the compiler and the
CPU's features, and loaded with ctypes. They run on torch's own OpenMP thread pool: the library
links `libgomp.so.1`, which resolves to the copy torch has already loaded.

Each kernel has an AVX-512 source (native/*.c) and, for CPUs with AVX2, FMA and F16C but no AVX-512,
an AVX2 one with the same C ABI (native/avx2/*.c); `variant()` picks the one this CPU runs. A kernel
with no SIMD code of its own has one source for both (native/common/*.c). Where
no compiler is available, the CPU has neither, the variant has no source for a kernel, or
`CORRAL_NATIVE_KERNELS=0`, `load()` returns None and the backend uses torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "native"
COMMON_DIR = SOURCE_DIR / "common"  # kernels without SIMD code, built for whichever variant the CPU runs
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
COMPILE_SECONDS = 120


def enabled() -> bool:
    return os.environ.get("CORRAL_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    configured = os.environ.get("CORRAL_KERNELS")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "corral" / "kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def int8_products_are_fast() -> bool:
    """Whether the CPU multiplies int8 in hardware (VNNI), which `torch._int_mm` needs to beat float32 BLAS.

    Without it torch's int8 matmul runs ~30x slower than the dequantized one (BENCHMARKS.md,
    Measurements behind code decisions).
    """
    flags = set(_cpu_features().split())
    return bool(flags & {"avx512_vnni", "avx_vnni", "avx_vnni_int8"}) or not _cpu_features().startswith("flags")


# variant -> (its sources' folder, the CPU flags it needs), best first
VARIANTS = {
    "avx512": (SOURCE_DIR, {"avx512f", "avx512bw"}),
    "avx2": (SOURCE_DIR / "avx2", {"avx2", "fma", "f16c"}),
}


def variant() -> str | None:
    """The kernels' variant this CPU runs ("avx512", "avx2"), or None where it has neither.

    Where the CPU does not say (no /proc/cpuinfo), "avx512": the compiler finds out (simd.h's #error).
    """
    features = _cpu_features()
    if not features.startswith("flags"):
        return "avx512"
    flags = set(features.split())
    return next((name for name, (_, needs) in VARIANTS.items() if needs <= flags), None)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


_BUILT_VARIANT: dict[str, str] = {}  # kernel -> the variant its last build or lookup was for (`loaded_variant`)


def _build(name: str) -> Path | None:
    compiler = _compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    chosen = variant()
    if chosen is None:
        log.info("native kernel %s skipped: this CPU has neither AVX-512 nor AVX2 with FMA and F16C; using torch's kernels", name)
        return None
    folder = VARIANTS[chosen][0]
    source = folder / f"{name}.c"
    if not source.exists() and (COMMON_DIR / f"{name}.c").exists():
        folder, source = COMMON_DIR, COMMON_DIR / f"{name}.c"  # plain C, the same for every variant
    if not source.exists():
        log.info("native kernel %s has no %s version yet; using torch's kernels", name, chosen)
        return None
    _BUILT_VARIANT[name] = chosen
    key = hashlib.sha256()
    # Headers and the folder's other sources (a kernel may #include another's: int4_blocks.c rms_norm.c)
    headers = [path.read_bytes() for path in sorted((*folder.glob("*.h"), *folder.glob("*.c"))) if path != source]
    for part in (source.read_bytes(), *headers, _compiler_version(compiler).encode(), _cpu_features().encode(), " ".join(FLAGS).encode()):
        key.update(part)
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True, timeout=COMPILE_SECONDS
        )
        if result.returncode != 0:
            log.warning("native kernel %s not built, using torch's kernels: %s", name, result.stderr.strip()[-2000:])
            return None
        os.replace(built, target)  # atomic: a concurrent process sees the whole library or none
    for stale in target.parent.glob(f"{name}-*.so"):  # earlier sources' builds (a loaded one stays mapped)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


# Process-wide memos, and rightly so: a library loaded with ctypes stays mapped until the process
# exits, so the process is the lifetime of `load`'s and `function`'s answers.
@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled library `native/<name>.c`, or None where it cannot be built here."""
    if not enabled():
        return None
    try:
        path = _build(name)
        return None if path is None else ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native kernel %s unavailable, using torch's kernels: %s", name, exc)
        return None


def loaded_variant(name: str) -> str | None:
    """The variant ("avx512", "avx2") of the loaded library `native/<name>.c`, None where none loads: what
    decides a layout its kernels read (layouts.Int4Blocks.pack), as the library in use, not the CPU's flags."""
    return _BUILT_VARIANT.get(name) if load(name) is not None else None


_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class RowAttentionArgs(ctypes.Structure):
    """native/row_attention.c's `struct row_attention_args`, field for field."""

    _fields_ = [
        ("q", _ptr), ("rows", _i64), ("heads", _i64), ("kv_heads", _i64), ("key_dim", _i64), ("value_dim", _i64),
        ("keys", _ptr), ("values", _ptr), ("cells", _i64), ("bf16", _int),
        ("starts", _ptr), ("used", _ptr), ("masks", _ptr), ("dest", _ptr),
        ("new_keys", _ptr), ("new_values", _ptr), ("key_stride", _i64), ("value_stride", _i64),
        ("scale", ctypes.c_float), ("out", _ptr), ("threads", _int),
    ]  # fmt: skip


# function -> (source file, argument types)
SIGNATURES = {
    "int4_blocks_matmul": ("int4_blocks", (_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _int)),
    "int4_blocks_normed": ("int4_blocks", (_ptr, _int, _i64, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _ptr, _int, _i64, _ptr, _int)),
    "int8_rows_matmul": ("int8_rows", (_ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int)),
    "int4_blocks_added": ("int4_blocks", (_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _int)),
    "int4_columns_coarse": ("int4_columns", (_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _int)),
    "topk_rows": ("topk_rows", (_ptr, _i64, _i64, _i64, _ptr, _ptr, _int)),
    "int8_rows_added": ("int8_rows", (_ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _int)),
    "int8_rows_normed": ("int8_rows", (_ptr, _int, _i64, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _i64, _ptr, _int)),
    "int8_two_levels": ("int8_rows", (_ptr, _int, _i64, _i64, _ptr, _ptr, _int)),
    "int8_two_level_out": ("int8_rows", (_ptr, _ptr, _ptr, _i64, _i64, _ptr, _int)),
    "rms_norm": ("rms_norm", (_ptr, _int, _i64, _i64, _ptr, ctypes.c_float, _ptr, _int)),
    "gated": ("gated", (_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _int)),
    "row_attention": ("row_attention", (ctypes.POINTER(RowAttentionArgs),)),
    "rope_heads": ("rope", (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _int, _ptr, _ptr)),
}
RESTYPES = {name: ctypes.c_int for name in ("row_attention", "int4_columns_coarse", "int4_blocks_normed", "int8_rows_normed", "int4_blocks_added", "int8_rows_added")}
MAX_HEAD_GROUP = 16  # query heads per kv head the attention kernel takes


@functools.cache
def function(name: str) -> Any:
    """The native function `name` (see SIGNATURES), or None where its library cannot be built here."""
    source, argtypes = SIGNATURES[name]
    library = load(source)
    if library is None:
        return None
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, RESTYPES.get(name)
    return fn


def has(name: str) -> bool:
    return function(name) is not None


PER_CALL = object()  # a BoundCall argument given at each call (an address)
THREADS = object()  # a BoundCall argument read at each call: torch's thread count (set_threads may change it)


class BoundCall:
    """A native function called at every step of a replayed plan with the same sizes (graph.Plan).

    `function(name)(...)` converts each of a dozen arguments at every call, and its wrapper above
    checks and allocates: ~20 us of Python a node, as much as the kernels of a small model's decode
    step (measured: BENCHMARKS.md, "Bound calls"). Here the constant arguments (sizes, flags, an
    output allocated once) are converted once; the addresses marked PER_CALL are given at each
    call, so a weight whose storage moves (stacking) or an input made anew each step is read where
    it is now."""

    __slots__ = ("raw", "args", "per_call", "threads")

    def __init__(self, name: str, template: tuple):
        source, argtypes = SIGNATURES[name]
        library = load(source)
        if library is None:
            raise RuntimeError(f"native kernel {name} is not built here")
        self.raw = library[name]  # a handle of its own, without argtypes to check at each call
        self.raw.restype = RESTYPES.get(name)
        self.args = [kind() if a is PER_CALL or a is THREADS else kind(a) for kind, a in zip(argtypes, template, strict=True)]
        self.per_call = [i for i, a in enumerate(template) if a is PER_CALL]
        self.threads = self.args[template.index(THREADS)] if any(a is THREADS for a in template) else None

    def __call__(self, *addresses: int) -> Any:
        args = self.args
        for i, address in zip(self.per_call, addresses):
            args[i].value = address
        if self.threads is not None:
            self.threads.value = torch.get_num_threads()
        return self.raw(*args)


def plain_rows(x: torch.Tensor, dtypes: tuple = (torch.float32, torch.bfloat16)) -> bool:
    """Whether the kernels read x [rows, cols] as it is (`_floats` would hand it on unchanged)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.dtype in dtypes and x.is_contiguous()


def _floats(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous float32 or bf16 (the dtypes the kernels read)."""
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def int4_blocks_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (float32 or bf16) times the 4-bit weight's transpose -> float32 [rows, out]
    (layout and arithmetic: native/int4_blocks.c; scales and mins both float16 or both float32)."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    if rows:
        # Pointers are read at each call: stacking may move a weight's storage after load.
        function("int4_blocks_matmul")(
            x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(),
            mins.data_ptr(), scales.dtype is torch.float16, codes.shape[0], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out


def int4_columns_coarse(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (float32 or bf16) times the column-grouped 4-bit weight's transpose, coarsely
    (int8 activations, a scale per 32), for ranking candidates -> float32 [rows, out]
    (layout and arithmetic: native/int4_columns.c; scales and mins both float16 or both float32)."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0] * 16), dtype=torch.float32)
    if rows and function("int4_columns_coarse")(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
        scales.dtype is torch.float16, out.shape[1], out.data_ptr(), torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("native int4 columns kernel could not allocate its quantized rows")
    return out


def takes_topk_rows(x: torch.Tensor, k: int) -> bool:
    """Whether `topk_rows` takes x [rows, n] (float32 on the CPU) and k."""
    return x.device.type == "cpu" and x.dtype is torch.float32 and x.dim() == 2 and 0 < k <= x.shape[1] and has("topk_rows")


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [rows, n] and their int64 indices, largest first, of
    equal values the lower index first (native/common/topk_rows.c): one pass over each row."""
    x = x if x.is_contiguous() else x.contiguous()
    rows, n = x.shape
    values, indices = torch.empty((rows, k), dtype=torch.float32), torch.empty((rows, k), dtype=torch.int64)
    if rows:
        function("topk_rows")(x.data_ptr(), rows, n, k, values.data_ptr(), indices.data_ptr(), torch.get_num_threads())
    return values, indices


def int4_blocks_normed(
    x: torch.Tensor, weight: torch.Tensor, eps: float, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """int4_blocks_matmul(rms_norm(x, weight, eps), ...) in one call, the same bits as the two."""
    x = _floats(x)
    rows, cols = x.shape
    if weight.numel() != cols:
        raise ValueError(f"rms_norm weight has {weight.numel()} values for rows of {cols}")
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    failed = rows and function("int4_blocks_normed")(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, weight.data_ptr(), eps, codes.data_ptr(), scales.data_ptr(),
        mins.data_ptr(), scales.dtype is torch.float16, codes.shape[0], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native int4 kernel could not allocate its normed rows")
    return out


def takes_int8_rows(codes: torch.Tensor) -> bool:
    """Whether the native int8 kernel takes a weight of these codes [out, in]."""
    out_features, in_features = codes.shape
    return codes.device.type == "cpu" and out_features % 16 == 0 and in_features % 32 == 0 and has("int8_rows_matmul")


def int8_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (float32 or bf16) times (codes int8 [out, in] * scales bf16 [out])^T -> float32
    [rows, out] (native/int8_rows.c)."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    if rows:
        function("int8_rows_matmul")(
            x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(), codes.shape[0],
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out


def takes_residual(residual: torch.Tensor, rows: int, out_features: int, norm: torch.Tensor | None = None) -> bool:
    """Whether the `*_added` kernels read this residual (and norm weight) for an output [rows, out_features]."""
    return (
        residual.dtype is torch.float32 and residual.device.type == "cpu" and residual.shape == (rows, out_features)
        and residual.is_contiguous()
        and (norm is None or (norm.dtype is torch.float32 and norm.is_contiguous() and norm.numel() == out_features))
    )  # fmt: skip


def int4_blocks_added(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, residual: torch.Tensor,
    norm: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:
    """residual + int4_blocks_matmul(x, ...), or residual + rms_norm(that product, norm, eps), in one
    call (`takes_residual`), the same bits as the separate calls."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    failed = rows and function("int4_blocks_added")(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
        scales.dtype is torch.float16, codes.shape[0], None if norm is None else norm.data_ptr(), eps, residual.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native int4 kernel could not allocate its product")
    return out


def int8_rows_added(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """residual + int8_rows_matmul(x, codes, scales), or residual + rms_norm(that product, norm, eps),
    in one call (`takes_residual`), the same bits as the separate calls."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    failed = rows and function("int8_rows_added")(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(), codes.shape[0],
        None if norm is None else norm.data_ptr(), eps, residual.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native int8 kernel could not allocate its product")
    return out


def int8_rows_normed(x: torch.Tensor, weight: torch.Tensor, eps: float, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_rows_matmul(rms_norm(x, weight, eps), codes, scales) in one call, the same bits as the two."""
    x = _floats(x)
    rows, cols = x.shape
    if weight.numel() != cols:
        raise ValueError(f"rms_norm weight has {weight.numel()} values for rows of {cols}")
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    failed = rows and function("int8_rows_normed")(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, weight.data_ptr(), eps, codes.data_ptr(), scales.data_ptr(),
        codes.shape[0], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native int8 kernel could not allocate its normed rows")
    return out


def int8_prompt_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Prompt rows x [rows, in] times (codes int8 [out, in] * scales bf16 [out])^T -> float32, as one
    torch._int_mm over both levels of each row (native/int8_rows.c quantizes and scales)."""
    x = _floats(x)
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    if not rows:
        return out
    threads = torch.get_num_threads()
    levels = torch.empty((2 * rows, cols), dtype=torch.int8)
    row_scales = torch.empty((2, rows), dtype=torch.float32)
    function("int8_two_levels")(x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, levels.data_ptr(), row_scales.data_ptr(), threads)
    products = torch._int_mm(levels, codes.t())  # exact; K * 127 * 127 fits int32 for K < 133000
    function("int8_two_level_out")(products.data_ptr(), row_scales.data_ptr(), scales.data_ptr(), rows, codes.shape[0], out.data_ptr(), threads)
    return out


# Bound forms of the wrappers above, for graph.Plan (BoundCall): each takes the rows its plan will
# pass (`plain_rows`) and returns the output it fills at every call and the call, whose PER_CALL
# addresses are, in order, those named in its docstring. Weights' addresses are per call (stacking
# moves a weight's storage); a norm weight's is constant (never stacked, held by the graph).


def bind_int4_blocks(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, added: bool = False) -> tuple[torch.Tensor, BoundCall]:
    """int4_blocks_normed (`norm`, not `added`), or int4_blocks_added (with the post-norm `norm` if
    any): addresses x, codes, scales, mins, then the residual where `added`."""
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    bf16, half, n = x.dtype is torch.bfloat16, scales.dtype is torch.float16, codes.shape[0]
    norm_address = None if norm is None else norm.data_ptr()
    if added:
        template = (PER_CALL, bf16, rows, cols, PER_CALL, PER_CALL, PER_CALL, half, n, norm_address, eps, PER_CALL, out.data_ptr(), THREADS)
        return out, BoundCall("int4_blocks_added", template)
    template = (PER_CALL, bf16, rows, cols, norm_address, eps, PER_CALL, PER_CALL, PER_CALL, half, n, out.data_ptr(), THREADS)
    return out, BoundCall("int4_blocks_normed", template)


def bind_int8_rows(x: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, added: bool = False) -> tuple[torch.Tensor, BoundCall]:
    """int8_rows_normed (`norm`, not `added`), or int8_rows_added (with the post-norm `norm` if any):
    addresses x, codes, scales, then the residual where `added`."""
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    bf16, n = x.dtype is torch.bfloat16, codes.shape[0]
    norm_address = None if norm is None else norm.data_ptr()
    if added:
        template = (PER_CALL, bf16, rows, cols, PER_CALL, PER_CALL, n, norm_address, eps, PER_CALL, out.data_ptr(), THREADS)
        return out, BoundCall("int8_rows_added", template)
    template = (PER_CALL, bf16, rows, cols, norm_address, eps, PER_CALL, PER_CALL, n, out.data_ptr(), THREADS)
    return out, BoundCall("int8_rows_normed", template)


def bind_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, BoundCall]:
    """rms_norm of rows like x (contiguous, float32 or bf16): address x."""
    out = torch.empty(x.shape, dtype=torch.float32)
    dim = x.shape[-1]
    template = (PER_CALL, x.dtype is torch.bfloat16, x.numel() // dim, dim, weight.data_ptr(), eps, out.data_ptr(), THREADS)
    return out, BoundCall("rms_norm", template)


def bind_gated_halves(y: torch.Tensor, width: int, activation: str) -> tuple[torch.Tensor, BoundCall]:
    """gated_halves of rows like y: addresses gate and up (y's start, and 4 * width bytes on)."""
    rows = y.shape[0]
    out = torch.empty((rows, width), dtype=torch.float32)
    template = (PER_CALL, y.stride(0), PER_CALL, y.stride(0), rows, width, GATES[activation], out.data_ptr(), THREADS)
    return out, BoundCall("gated", template)


def bind_rope_heads(
    rows: int, x_stride: int, heads: int, split: int, head_dim: int, dims: int, neox: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor], BoundCall]:
    """rope_heads over float32 rows of unit column stride and row stride `x_stride`: addresses x
    (its first head's column) and the (cos, sin) pairs [rows, 1, dims / 2, 2] float32 contiguous."""
    q = torch.empty((rows, split, head_dim), dtype=torch.float32)
    k = torch.empty((rows, heads - split, head_dim), dtype=torch.float32)
    template = (PER_CALL, rows, x_stride, heads, split, head_dim, PER_CALL, dims, neox, q.data_ptr(), k.data_ptr())
    return (q, k), BoundCall("rope_heads", template)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension of x (float32 or bf16) with a float32 weight -> float32."""
    x = _floats(x)
    out = torch.empty(x.shape, dtype=torch.float32)
    dim = x.shape[-1]
    if weight.numel() != dim:
        raise ValueError(f"rms_norm weight has {weight.numel()} values for rows of {dim}")
    rows = x.numel() // dim if dim else 0
    if rows:
        function("rms_norm")(x.data_ptr(), x.dtype is torch.bfloat16, rows, dim, weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


GATES = {"silu": 0, "gelu_tanh": 1}  # gated.c's activations


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(gate) * up -> float32, one pass (native/gated.c): gate and up float32 [rows,
    width] with unit column strides (column slices of one fused output are read in place)."""
    rows, width = gate.shape
    if up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gated: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal rows of unit stride")
    out = torch.empty((rows, width), dtype=torch.float32)
    if rows:
        function("gated")(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, width, GATES[activation], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def gated_halves(y: torch.Tensor, width: int, activation: str) -> torch.Tensor:
    """activation(y[:, :width]) * y[:, width:] -> float32 [rows, width] (native/gated.c), the halves
    of a fused gate/up output y (float32 [rows, 2 * width], unit column stride) read in place."""
    rows = y.shape[0]
    if y.shape[1] != 2 * width or y.stride(1) != 1 or y.dtype is not torch.float32:
        raise ValueError(f"gated_halves: {tuple(y.shape)} {y.dtype} is not two float32 halves of {width}")
    out = torch.empty((rows, width), dtype=torch.float32)
    if rows:
        gate = y.data_ptr()
        function("gated")(gate, y.stride(0), gate + 4 * width, y.stride(0), rows, width, GATES[activation], out.data_ptr(), torch.get_num_threads())
    return out


def takes_row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the native attention kernel takes these shapes and dtypes (fixed for a model)."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    return (
        keys.device.type == "cpu" and keys.dtype == values.dtype and keys.dtype in (torch.bfloat16, torch.float32)
        and q.shape[-1] % 16 == 0 and values.shape[-1] % 16 == 0 and heads % kv_heads == 0
        and heads // kv_heads <= MAX_HEAD_GROUP and keys.is_contiguous() and values.is_contiguous()
        and has("row_attention")
    )  # fmt: skip


class Regions:
    """An `attention_regions` array, its address (numpy's `.ctypes` is slow to read at every call;
    measured: BENCHMARKS.md, Measurements behind code decisions) and the masks its addresses
    point into (kept alive with it)."""

    __slots__ = ("array", "address", "masks")

    def __init__(self, array: np.ndarray, masks: list[torch.Tensor]):
        self.array, self.address, self.masks = array, array.ctypes.data, masks


def attention_regions(groups: list[Any], rows: int, dest: list[int] | None = None) -> Regions:
    """What `row_attention` reads, int64 [4, rows]: for each query row, in batch order, its
    sequence's first cell, the cells it reads (up to its last visible one: a prompt row skips the
    keys after it), the address of its mask row (0: every cell visible), and the cell its new key
    and value go to (`dest`: decode rows only)."""
    regions, masks = np.zeros((4, rows), dtype=np.int64), []
    for group in groups:
        index = group.rows if isinstance(group.rows, slice) else group.rows.cpu().numpy()
        regions[0, index] = group.start
        regions[1, index] = group.used
        mask = group.mask
        if mask is None:
            continue
        mask = mask if mask.is_contiguous() and mask.dtype == torch.bool else mask.to(torch.bool).contiguous()
        masks.append(mask)
        count = mask.shape[0]
        if count > 1:  # a masked cell adds an exact 0 to every sum: skipping those after the last visible changes nothing
            regions[1, index] = group.used - mask.flip(1).to(torch.uint8).argmax(1).numpy()
        regions[2, index] = mask.data_ptr() + np.arange(count, dtype=np.int64) * group.used
    if dest is not None:
        regions[3] = dest
    return Regions(regions, masks)


def _rows_of_heads(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [rows, heads, dim] as float32 with contiguous heads, and its row stride."""
    if x.dtype is not torch.float32:
        x = x.float()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x, x.stride(0)


def row_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, regions: Regions, scale: float, new: tuple | None = None
) -> torch.Tensor:
    """Each query row over its own cells (`attention_regions`) -> float32 [rows, heads, value_dim].
    q [rows, heads, key_dim]; keys, values [kv_heads, cells, dim] (native/row_attention.c).
    `new`: the rows' keys and values [rows, kv_heads, dim], stored first in their cells."""
    if q.dtype is not torch.float32 or not q.is_contiguous():
        q = q.float().contiguous()
    rows, heads, key_dim = q.shape
    kv_heads, cells, value_dim = values.shape
    out = torch.empty((rows, heads, value_dim), dtype=torch.float32)
    address, step = regions.address, rows * 8
    k = v = None
    key_stride = value_stride = 0
    if new is not None:
        (k, key_stride), (v, value_stride) = _rows_of_heads(new[0]), _rows_of_heads(new[1])
    args = RowAttentionArgs(
        q=q.data_ptr(), rows=rows, heads=heads, kv_heads=kv_heads, key_dim=key_dim, value_dim=value_dim,
        keys=keys.data_ptr(), values=values.data_ptr(), cells=cells, bf16=keys.dtype is torch.bfloat16,
        starts=address, used=address + step, masks=address + 2 * step, dest=None if k is None else address + 3 * step,
        new_keys=None if k is None else k.data_ptr(), new_values=None if v is None else v.data_ptr(),
        key_stride=key_stride, value_stride=value_stride, scale=scale, out=out.data_ptr(), threads=torch.get_num_threads(),
    )  # fmt: skip
    failed = function("row_attention")(ctypes.byref(args))
    if failed:
        raise MemoryError("native attention could not allocate its scores")
    return out


def plain_heads(x: torch.Tensor) -> bool:
    """Whether `row_attention` reads x [rows, heads, dim] as it is: float32 with contiguous heads."""
    return x.dtype is torch.float32 and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def bind_row_attention(
    rows: int, heads: int, key_dim: int, value_dim: int, scale: float, key_stride: int, value_stride: int
) -> tuple[torch.Tensor, Any]:
    """`row_attention` of decode rows storing their new keys and values (`new`), for graph.Plan:
    the output and the arguments' struct made once. Returns the output and `call(q, keys, values,
    regions, k, v)` for q [rows, heads, key_dim] float32 contiguous and k, v of `plain_heads` with
    these row strides."""
    out = torch.empty((rows, heads, value_dim), dtype=torch.float32)
    args = RowAttentionArgs(
        rows=rows, heads=heads, key_dim=key_dim, value_dim=value_dim, key_stride=key_stride, value_stride=value_stride,
        scale=scale, out=out.data_ptr(),
    )  # fmt: skip
    raw = load("row_attention")["row_attention"]
    raw.restype = ctypes.c_int
    pointer, step = ctypes.byref(args), rows * 8

    def call(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, regions: Regions, k: torch.Tensor, v: torch.Tensor) -> None:
        args.q, args.keys, args.values = q.data_ptr(), keys.data_ptr(), values.data_ptr()
        args.kv_heads, args.cells, args.bf16 = keys.shape[0], keys.shape[1], keys.dtype is torch.bfloat16
        address = regions.address
        args.starts, args.used, args.masks, args.dest = address, address + step, address + 2 * step, address + 3 * step
        args.new_keys, args.new_values, args.threads = k.data_ptr(), v.data_ptr(), torch.get_num_threads()
        if raw(pointer):
            raise MemoryError("native attention could not allocate its scores")

    return out, call


def rope_heads(
    x: torch.Tensor, heads: int, split: int, head_dim: int, pairs: torch.Tensor, dims: int, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads [0, heads) of x's rows rotated by `pairs` (cos, sin) [rows, 1, dims / 2, 2] (rope.py)
    with the same bits as the torch backend's `_rope` (native/common/rope.c): the first `split` as
    float32 [rows, split, head_dim], the others as [rows, heads - split, head_dim]. x: float32 rows
    [rows, >= heads * head_dim] of unit column stride (a column slice of a fused q/k/v output is
    read in place), or [rows, heads, head_dim] with packed heads."""
    rows = x.shape[0]
    if x.dtype is not torch.float32 or x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != head_dim):
        x = x.float().contiguous()
    if pairs.shape[0] != rows or pairs.shape[-2] * 2 != dims or pairs.dtype is not torch.float32 or not pairs.is_contiguous():
        raise ValueError(f"rope_heads: a table {tuple(pairs.shape)} {pairs.dtype} for {rows} rows of {dims} rotated features")
    q = torch.empty((rows, split, head_dim), dtype=torch.float32)
    k = torch.empty((rows, heads - split, head_dim), dtype=torch.float32)
    if rows:
        function("rope_heads")(
            x.data_ptr(), rows, x.stride(0), heads, split, head_dim, pairs.data_ptr(), dims, neox, q.data_ptr(), k.data_ptr()
        )  # fmt: skip
    return q, k
