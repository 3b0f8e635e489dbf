"""ggml's own block quantizers, compiled from llama.cpp's sources into a small shared library for tests.

The reference for `corral.quantize` is what llama-quantize writes. Without an importance matrix it
quantizes each tensor with ggml's `quantize_row_<type>_ref` (ggml/src/ggml-quants.c), so compiling that
one file, with the flags the ggml-base library gets in a Release build (-O3, no -march: plain x86-64,
no fused multiply-add), gives the same bytes as llama-quantize at a fraction of its build time (about
ten seconds of one core). The four ggml functions ggml-quants.c calls only on paths the tests never take
(importance matrices, row validation) come from a tiny link shim below. The library is cached under the
peers cache dir, keyed by the hash of its sources and flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np

import peers

FLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-std=gnu11", "-shared"]
# Defines what ggml-quants.c links against but never calls on the reference paths (each aborts).
SHIM = r"""
#include <stdlib.h>
#include "ggml.h"
void ggml_abort(const char * file, int line, const char * fmt, ...) { (void) file; (void) line; (void) fmt; abort(); }
size_t ggml_row_size(enum ggml_type type, int64_t ne) { (void) type; (void) ne; abort(); }
const char * ggml_type_name(enum ggml_type type) { (void) type; abort(); }
size_t ggml_type_size(enum ggml_type type) { (void) type; abort(); }
"""
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_SIZE = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


class NoCompilerError(RuntimeError):
    """Neither $CC, gcc nor cc is here."""


class GGMLQuants:
    """ctypes access to `quantize_row_<type>_ref` of a compiled ggml-quants.c."""

    def __init__(self, library: pathlib.Path):
        self._lib = ctypes.CDLL(str(library))

    def quantize(self, values: np.ndarray, type_name: str) -> np.ndarray:
        """float32 rows -> uint8 rows of `type_name` blocks, as ggml quantizes them."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        count = values.size // BLOCK_SIZE[type_name]
        out = np.zeros(count * BLOCK_BYTES[type_name], np.uint8)
        function = getattr(self._lib, f"quantize_row_q{type_name[1:]}_ref")
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        function.restype = None
        function(values.ctypes.data, out.ctypes.data, values.size)
        row_bytes = values.shape[-1] // BLOCK_SIZE[type_name] * BLOCK_BYTES[type_name]
        return out.reshape(*values.shape[:-1], row_bytes)


def compiler() -> str | None:
    """The C compiler to build with: $CC, else gcc or cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def load(llama_cpp: pathlib.Path) -> GGMLQuants:
    """ggml's quantizers from `llama_cpp`'s sources; the calling test is skipped when no compiler is here."""
    import pytest

    try:
        return GGMLQuants(build(llama_cpp))
    except NoCompilerError as error:
        pytest.skip(f"{error} (.ci/run installs gcc)")


def build(llama_cpp: pathlib.Path) -> pathlib.Path:
    """Compile ggml-quants.c (once per source hash) and return the shared library's path."""
    ggml = llama_cpp / "ggml"
    source = ggml / "src" / "ggml-quants.c"
    key = hashlib.sha256()
    for part in (source, ggml / "src" / "ggml-quants.h", ggml / "src" / "ggml-common.h", ggml / "src" / "ggml-impl.h"):
        key.update(part.read_bytes())
    key.update(" ".join(FLAGS).encode() + SHIM.encode())
    target = peers.cache_dir() / "ggml-quants" / key.hexdigest()[:16] / "libggml-quants-ref.so"
    if target.is_file():
        return target
    cc = compiler()
    if cc is None:
        raise NoCompilerError("no C compiler (gcc) to build ggml's reference quantizers")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        shim = pathlib.Path(work) / "shim.c"
        shim.write_text(SHIM)
        built = pathlib.Path(work) / target.name
        includes = ["-I", str(ggml / "src"), "-I", str(ggml / "include")]
        subprocess.run([cc, *FLAGS, *includes, str(source), str(shim), "-lm", "-o", str(built)], check=True)
        os.replace(built, target)  # whole or not at all: an interrupted build leaves nothing behind
    return target
