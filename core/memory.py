"""Predict what loading a model will cost in memory, before loading it.

weights (as the torch backend lays them out) + KV cache (num_ctx x num_parallel cells per layer,
sliding-window layers only their window) + compute buffers (one num_batch step's activations and
the logits rows). The scheduler evicts idle models when the prediction does not fit.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import attrs
from gguf import GGMLQuantizationType as Q

from corral.gguf import GGUFFile

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
KV_BYTES = 2  # bf16 cache
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / 32  # packed nibbles + bf16 scale and zero per group of 32
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


@attrs.frozen
class MemoryEstimate:
    weights: int
    kv_cache: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


def estimate(path: str | os.PathLike, num_ctx: int, num_parallel: int, num_batch: int = 512) -> MemoryEstimate:
    """Bytes the model at `path` will need with this context, parallelism and batch size."""
    gguf = GGUFFile.open(path)
    arch = gguf.architecture
    num_ctx = min(num_ctx, int(_meta(gguf, arch, "context_length", num_ctx)))  # the runtime clamps it too
    return MemoryEstimate(
        weights=_weights(gguf),
        kv_cache=_kv_cache(gguf, arch, num_ctx, num_parallel, num_batch),
        compute=_compute(gguf, arch, num_batch, num_parallel),
    )


def _weights(gguf: GGUFFile) -> int:
    total = 0.0
    for info in gguf.tensors.values():
        count = 1
        for dim in info.shape:
            count *= dim
        if len(info.shape) == 1:
            total += 4 * count  # vectors: float32
        elif info.name.startswith("token_embd") and "output.weight" in gguf.tensors:
            continue  # an untied embedding is read from the file's map, a row at a time
        elif info.qtype in FLOAT_TYPES:
            total += 4 * count
        elif info.name.startswith(("token_embd", "output.")):
            total += INT4_BYTES_PER_WEIGHT * count  # the logits' 4-bit copy (exact rows come from the file)
        elif info.qtype in INT4_TYPES:
            total += INT4_BYTES_PER_WEIGHT * count
        else:
            total += count  # other quantized linears: int8 per row
    return int(total)


def _meta(gguf: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    return gguf.get(f"{arch}.{key}", default)


def _kv_cache(gguf: GGUFFile, arch: str, num_ctx: int, num_parallel: int, num_batch: int) -> int:
    layers = int(_meta(gguf, arch, "block_count", 0))
    heads = int(_meta(gguf, arch, "attention.head_count", 1))
    kv_heads = int(_meta(gguf, arch, "attention.head_count_kv", heads) or heads)
    embd = int(_meta(gguf, arch, "embedding_length", 0))
    key_dim = int(_meta(gguf, arch, "attention.key_length", embd // max(heads, 1)))
    value_dim = int(_meta(gguf, arch, "attention.value_length", key_dim))
    window = _meta(gguf, arch, "attention.sliding_window")
    per_cell = kv_heads * (key_dim + value_dim) * KV_BYTES
    cells = num_ctx * num_parallel
    if window:
        # gemma3-style: 5 of every 6 layers keep only their window (plus a batch) per sequence.
        local = layers - layers // 6
        window_cells = min(cells, num_parallel * (int(window) + num_batch))
        return per_cell * ((layers - local) * cells + local * window_cells)
    return per_cell * layers * cells


def _compute(gguf: GGUFFile, arch: str, num_batch: int, num_parallel: int) -> int:
    embd = int(_meta(gguf, arch, "embedding_length", 0))
    ffn = int(_meta(gguf, arch, "feed_forward_length", 4 * embd))
    vocab = len(gguf.get("tokenizer.ggml.tokens", ())) or int(_meta(gguf, arch, "vocab_size", 32000))
    activations = num_batch * (4 * embd + 3 * ffn) * 4
    logits = max(num_parallel, 1) * vocab * 4 * 2
    return activations + logits


def resident_bytes() -> int:
    """This process's resident memory plus what torch holds on the GPU."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = 0
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        resident += sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
    return resident


def available_bytes() -> int | None:
    """Memory the next model may use: free GPU memory under CUDA, else the system's MemAvailable."""
    try:
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return int(free)
    except Exception:  # noqa: BLE001 - no usable GPU: fall back to system memory
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# glibc mallopt parameters (malloc.h) and the values corral sets; see reuse_large_buffers.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed on 64-bit
TRIM_THRESHOLD_BYTES = 128 << 20


def reuse_large_buffers() -> None:
    """Keep freed activation buffers in the heap for the next step to reuse.

    With glibc's dynamic thresholds, whether a step's freed buffers are unmapped (and the next
    step faults all their pages in again) depends on the order of earlier frees: a third of the
    processes page-faulted their buffers in again in every prefill, a much slower step
    (measured: BENCHMARKS.md, Measurements behind code decisions).
    Fixed thresholds (big buffers from the heap, its top trimmed only past 128 MB) make every
    process take the fast path. Memory freed at load time is still handed back by
    `release_freed_memory`.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator has its own policy


def release_freed_memory() -> None:
    """Hand memory freed after a load (conversion buffers, tokenizer building) back to the system.

    glibc keeps freed heap pages for reuse, so without this RSS stays at the load's peak.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim
