"""Native CPU kernels of the torch backend: small C files (native/) compiled for this machine.

torch ships no CPU kernel that multiplies 4-bit weights with integer arithmetic (its int4 kernel
dequantizes every weight to fp32 per group of 4 activation rows). The kernels here fill that gap
and nothing else. Like torch.compile's C++ backend, they are built on first use with the system C
compiler (`$CC`, else `cc`) for this CPU (`-march=native`), cached under
`$CORRAL_KERNELS` (default `~/.cache/corral/kernels`) by a hash of the source, the compiler and the
CPU's features, and loaded with ctypes. They run on torch's own OpenMP thread pool: the library
links `libgomp.so.1`, which resolves to the copy torch has already loaded.

Where no compiler or no AVX-512 is available, or `CORRAL_NATIVE_KERNELS=0`, `load()` returns None
and the backend uses torch's kernels.
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

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "native"
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


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _build(name: str) -> Path | None:
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    key = hashlib.sha256()
    for part in (source.read_bytes(), _compiler_version(compiler).encode(), _cpu_features().encode(), " ".join(FLAGS).encode()):
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
    return target


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


@functools.cache
def _int4_blocks() -> ctypes._CFuncPtr | None:
    library = load("int4_blocks")
    if library is None:
        return None
    fn = library.int4_blocks_matmul
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = (ptr, ctypes.c_int, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int)
    fn.restype = None
    return fn


def has_int4_blocks() -> bool:
    return _int4_blocks() is not None


def int4_blocks_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (float32 or bf16) times the 4-bit weight's transpose -> float32 [rows, out]
    (layout and arithmetic: native/int4_blocks.c)."""
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        x = x.float()
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty((rows, codes.shape[0]), dtype=torch.float32)
    if rows:
        # Pointers are read at each call: stacking may move a weight's storage after load.
        _int4_blocks()(
            x.data_ptr(), x.dtype is torch.bfloat16, rows, cols, codes.data_ptr(), scales.data_ptr(),
            mins.data_ptr(), codes.shape[0], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out
