"""Predict what loading a model will cost in memory, before loading it.

weights (each tensor as the backend will hold it, for the role the architecture binds it to) + KV
cache (the cells the runtime will allocate for each layer, from the architecture's cache layout) +
compute buffers (one num_batch step's activations and the logits rows). The scheduler evicts idle
models when the prediction does not fit. No architecture or backend is known here by name: both
are asked, through the plugins.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import attrs

from corral.gguf import GGUFFile
from corral.kvcache import CausalCache, runtime_cells
from corral.model import config_from_gguf
from corral.registry import Plugins


@attrs.frozen
class MemoryEstimate:
    weights: int
    kv_cache: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


def estimate(
    path: str | os.PathLike, num_ctx: int, num_parallel: int, num_batch: int = 512, plugins: Plugins | None = None,
    projector: str | os.PathLike | None = None,
) -> MemoryEstimate:
    """Bytes the model at `path` (and its vision `projector`) will need with this context, parallelism and batch size.

    A projector's weights count as its file's size: its tensors are float32 and float16, held dense.

    Raises UnknownArchitectureError when no installed plugin runs the file, and what binding raises
    (missing metadata or tensors) when the file does not match its architecture.
    """
    plugins = plugins or Plugins()
    gguf = GGUFFile.open(path)
    model_class = plugins.architecture_for(gguf)
    backend = plugins.open_backend()
    config = config_from_gguf(model_class.Config, gguf, gguf.architecture)
    num_ctx = min(num_ctx, int(config.context_length))  # the runtime clamps it too
    num_batch = max(1, min(num_batch, num_ctx))  # and the batch to the context
    weights = backend.resident_bytes(model_class.tensor_plan(gguf)) + (os.path.getsize(projector) if projector else 0)
    return MemoryEstimate(
        weights=int(weights),
        kv_cache=_kv_cache(backend, model_class.cache_layout(config), num_ctx, num_parallel, num_batch),
        compute=_compute(gguf, gguf.architecture, num_batch, num_parallel),
    )


def _kv_cache(backend: Any, layers: list, num_ctx: int, num_parallel: int, num_batch: int) -> int:
    num_cells, window_cells = runtime_cells(layers, num_ctx, num_parallel, num_batch)
    cells = CausalCache.layer_cells(layers, num_cells, window_cells, num_parallel)
    return sum(
        backend.kv_buffer_bytes(keys) + backend.kv_buffer_bytes(values)
        for keys, values in CausalCache.buffer_shapes(layers, cells)
    )


def _compute(gguf: GGUFFile, arch: str, num_batch: int, num_parallel: int) -> int:
    embd = int(gguf.get(f"{arch}.embedding_length", 0))
    ffn = int(gguf.get(f"{arch}.feed_forward_length", 4 * embd))
    vocab = len(gguf.get("tokenizer.ggml.tokens", ())) or int(gguf.get(f"{arch}.vocab_size", 32000))
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
