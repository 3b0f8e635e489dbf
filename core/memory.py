"""Predict what loading a model will cost in memory, before loading it, and fit the context to it.

weights (each tensor as the backend will hold it, for the role the architecture binds it to) + KV
cache (the cells the runtime will allocate for each layer, from the architecture's cache layout) +
compute buffers (one num_batch step's activations and the logits rows). No architecture or backend
is known here by name: both are asked, through the plugins.

`plan_load` runs where the model is loaded (the runner process, or an in-process runtime): it compares
the prediction with what the device has free and lowers the context until the model fits (the
effective context: trained ∩ requested ∩ fits, logged), or refuses with InsufficientMemoryError when
even MIN_NUM_CTX does not fit, so a model too big is a clear error rather than a runner the kernel
kills. The server never calls it: the backend (torch) lives in the runner.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any, Callable

import attrs

from corral.errors import CorralError, InsufficientMemoryError
from corral.gguf import GGUFFile
from corral.kvcache import DEFAULT_KV_CACHE_TYPE, CausalCache, kv_cache_type_for, runtime_cells
from corral.model import config_from_gguf
from corral.registry import Plugins

log = logging.getLogger(__name__)

MIN_NUM_CTX = 512  # below this a chat model is of little use: refuse rather than run it smaller
MEMORY_ENV = "CORRAL_MEMORY_LIMIT"  # bytes (or "512MiB", "2GB"): treat only this much as available


# The tokenizer's vocabulary, merges and lookup tables as Python objects: measured ~710 bytes per token for
# both smollm2 (49,152 tokens: 33 MB) and gemma3 (262,144 tokens: 178 MB).
TOKENIZER_BYTES_PER_TOKEN = 710


@attrs.frozen
class MemoryEstimate:
    weights: int
    kv_cache: int
    compute: int
    tokenizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.tokenizer


@attrs.frozen
class LoadPlan:
    """The context and KV cache type a model will load with, what that is predicted to cost, and what was available."""

    num_ctx: int
    estimate: MemoryEstimate
    available: int | None
    kv_cache_type: str = DEFAULT_KV_CACHE_TYPE


class Estimator:
    """The memory prediction of one file on one backend, for any context (the file is read once).

    The KV cache type is checked against the model's head dims first (`kv_cache_type_for`): with
    `kv_cache_fallback` one the backend cannot take becomes f16 (`kv_cache_replaced` says why; plan_load warns),
    else it is refused.
    """

    def __init__(self, path: str | os.PathLike, num_parallel: int, num_batch: int = 512, plugins: Plugins | None = None,
                 backend: Any = None, projector: str | os.PathLike | None = None, kv_cache_type: str = DEFAULT_KV_CACHE_TYPE,
                 kv_cache_fallback: bool = False):
        plugins = plugins or Plugins()
        gguf = GGUFFile.open(path)
        model_class = plugins.architecture_for(gguf)
        self.backend = backend or plugins.open_backend()
        config = config_from_gguf(model_class.Config, gguf, gguf.architecture)
        self.trained = int(config.context_length)
        # As the runtime does: a batch never exceeds the context, so a huge num_batch predicts no huge buffer.
        num_batch = max(1, min(num_batch, self.trained))
        self._layers = model_class.cache_layout(config)
        kv_cache_type, self.kv_cache_replaced = kv_cache_type_for(self.backend, self._layers, kv_cache_type, fallback=kv_cache_fallback)
        self.num_parallel, self.num_batch, self.kv_cache_type = num_parallel, num_batch, kv_cache_type
        # A vision projector's weights count as its file's size: its tensors are float32 and float16, held dense.
        self._weights = int(self.backend.resident_bytes(model_class.tensor_plan(gguf))) + (os.path.getsize(projector) if projector else 0)
        # What the backend's compute faults in beyond its tensors (kernel code pages and the like), if it says.
        overhead = getattr(self.backend, "compute_overhead_bytes", lambda: 0)()
        self._compute = _compute(gguf, gguf.architecture, num_batch, num_parallel) + int(overhead)
        self._heads = int(gguf.get(f"{gguf.architecture}.attention.head_count", 0) or 0)
        self._tokenizer = len(gguf.get("tokenizer.ggml.tokens", ())) * TOKENIZER_BYTES_PER_TOKEN

    def __call__(self, num_ctx: int) -> MemoryEstimate:
        """The prediction with `num_ctx` cells per sequence (clamped to the trained context, as the runtime does)."""
        num_ctx = min(num_ctx, self.trained)
        kv = _kv_cache(self.backend, self._layers, num_ctx, self.num_parallel, self.num_batch, self.kv_cache_type)
        # one prompt chunk's attention scores over the whole context, float32, one layer at a time: the scores
        # and their softmax live together (measured: the prompt's growth in RSS, BENCHMARKS.md "Memory")
        scores = min(self.num_batch, num_ctx) * num_ctx * self._heads * 4 * 2
        return MemoryEstimate(weights=self._weights, kv_cache=kv, compute=self._compute + scores, tokenizer=self._tokenizer)


def estimate(
    path: str | os.PathLike, num_ctx: int, num_parallel: int, num_batch: int = 512, plugins: Plugins | None = None,
    projector: str | os.PathLike | None = None, kv_cache_type: str = DEFAULT_KV_CACHE_TYPE,
) -> MemoryEstimate:
    """Bytes the model at `path` (and its vision `projector`) will need with this context, parallelism and batch size.

    Raises UnknownArchitectureError when no installed plugin runs the file, and what binding raises
    (missing metadata or tensors) when the file does not match its architecture.
    """
    return Estimator(path, num_parallel, num_batch, plugins, projector=projector, kv_cache_type=kv_cache_type)(num_ctx)


def plan_load(
    path: str | os.PathLike, num_ctx: int, num_parallel: int, num_batch: int = 512, plugins: Plugins | None = None,
    device: str | None = None, precision: str = "auto", available: int | None = None, lower_context: bool = True,
    projector: str | os.PathLike | None = None, kv_cache_type: str = DEFAULT_KV_CACHE_TYPE, kv_cache_fallback: bool = False,
    name: str = "",
) -> LoadPlan:
    """The context (and KV cache type, see Estimator) to load `path` with so that the prediction fits in `available`
    (default: what is free now); `name` is what warnings call the model (default: the file's name).

    With `lower_context` false a model that does not fit at `num_ctx` is refused rather than shrunk (the
    scheduler first tries that way, to unload idle models before it takes context from a new one).
    """
    plugins = plugins or Plugins()
    backend = plugins.open_backend(device=device, precision=precision)
    name = name or os.path.basename(os.fspath(path))
    estimator = Estimator(path, num_parallel, num_batch, plugins, backend, projector, kv_cache_type, kv_cache_fallback)
    if available is None:
        available = available_bytes(estimator.backend)
    num_ctx = min(num_ctx, estimator.trained)
    fitted = fit_context(estimator, num_ctx, available, name=name, floor=None if lower_context else num_ctx)
    # Warned only once the plan fits: a load the scheduler retries (it first refuses to lower the context while
    # idle models may be unloaded instead) is planned twice, and is one load.
    if estimator.kv_cache_replaced is not None:
        estimator.kv_cache_replaced.warn(name)
    return LoadPlan(fitted, estimator(fitted), available, estimator.kv_cache_type)


def fit_context(
    estimate_at: Callable[[int], MemoryEstimate], num_ctx: int, available: int | None, *, name: str = "", floor: int | None = None
) -> int:
    """The largest context from `floor` (default min(MIN_NUM_CTX, num_ctx)) up to `num_ctx` whose estimate fits
    in `available` bytes (any when that is unknown).

    The KV cache grows with the context and nothing else does, so the fit is a bisection. Raises
    InsufficientMemoryError when even `floor` does not fit.
    """
    wanted = estimate_at(num_ctx)
    if available is None or wanted.total <= available:
        return num_ctx
    floor = min(MIN_NUM_CTX, num_ctx) if floor is None else floor
    smallest = estimate_at(floor)
    if smallest.total > available:
        raise InsufficientMemoryError(
            f"{name or 'the model'} needs {_mib(smallest.total)} of memory (weights {_mib(smallest.weights)}, "
            f"KV cache {_mib(smallest.kv_cache)} at num_ctx {floor}) but only {_mib(available)} is available; "
            "unload other models, lower num_parallel (CORRAL_NUM_PARALLEL), or use a smaller quantization"
        )
    low, high = floor, num_ctx  # low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if estimate_at(middle).total <= available else (low, middle)
    log.warning(
        "%snum_ctx %d needs %s but %s is available; lowering the context to %d",
        f"{name}: " if name else "", num_ctx, _mib(wanted.total), _mib(available), low,
    )
    return low


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB"


def _kv_cache(backend: Any, layers: list, num_ctx: int, num_parallel: int, num_batch: int, cache_type: str) -> int:
    num_cells, window_cells = runtime_cells(layers, num_ctx, num_parallel, num_batch)
    cells = CausalCache.layer_cells(layers, num_cells, window_cells, num_parallel)
    return sum(
        backend.kv_buffer_bytes(keys, cache_type) + backend.kv_buffer_bytes(values, cache_type)
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


def available_bytes(backend: Any = None) -> int | None:
    """Memory the next model may use: what the backend's device has free (a GPU's), else the system's MemAvailable.

    CORRAL_MEMORY_LIMIT caps it (a container's share, or a test's simulated small machine).
    """
    free = getattr(backend, "available_bytes", lambda: None)()
    if free is None:
        free = _mem_available()
    limit = memory_limit()
    if limit is not None:
        free = limit if free is None else min(free, limit)
    return free


def memory_limit(environ: dict | None = None) -> int | None:
    """CORRAL_MEMORY_LIMIT in bytes ("2GiB", "512MB", "1000000"); None when unset."""
    value = (os.environ if environ is None else environ).get(MEMORY_ENV, "").strip()
    if not value:
        return None
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    number = value.rstrip("bBkKmMgGiI")
    try:
        return int(float(number) * units[value[len(number):].strip().lower()])
    except (ValueError, KeyError):
        raise CorralError(f"{MEMORY_ENV}={value!r} is not a size; use bytes or a size like 2GiB") from None


def _mem_available() -> int | None:
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
