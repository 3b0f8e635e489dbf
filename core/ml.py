"""The tensor backend contract: architectures build a graph against a Context, `compute()` runs it.

Model code only calls Context ops and never touches a backend's native tensors, so one model runs on
any backend, and a backend is free to execute the recorded graph eagerly, compiled or as a replayed
CUDA graph. Ops work on 2-D activations [tokens, features] unless the op says otherwise.

What a backend hands back is torch: `run` and `compute` return `torch.Tensor`s on the backend's
device (logits float32 or bfloat16 [rows, vocab]), and sampling, grammar masks and candidate
ranking (`sample.py`, `grammar.py`, `topk.py`) work on them in place on that device. Model code
stays backend-neutral; only the results are torch. A backend over another array library converts
its outputs (`torch.from_dlpack` shares the memory) — torch is a dependency of corral either way,
and one tensor type for sampling keeps a token's whole path on the device without copies.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from corral.gguf import GGUFFile, TensorInfo

# Roles a backend loads a tensor for; each may get its own layout (packed int4 for "linear", ...).
ROLES = ("linear", "logits", "embedding", "vector")


class Tensor(Protocol):
    """A node of the graph being built; `+` and `*` are the elementwise add and mul ops."""

    def __add__(self, other: Tensor) -> Tensor: ...

    def __mul__(self, other: Tensor) -> Tensor: ...


class Context(Protocol):
    """Graph-building ops; nothing runs until `compute()`."""

    def input(self, values: np.ndarray) -> Tensor:
        """An integer input (token ids, positions, row indices)."""

    def embedding(self, weight: Any, ids: Tensor) -> Tensor:
        """Rows of an embedding table: [n] -> [n, dim]."""

    def linear(self, x: Tensor, weight: Any, bias: Any = None) -> Tensor:
        """x @ weight.T (+ bias) with the weight in whatever layout the backend loaded it."""

    def rms_norm(self, x: Tensor, weight: Any, eps: float) -> Tensor:
        """RMS normalisation over the last dim, times weight (the file's weight, used as is)."""

    def layer_norm(self, x: Tensor, weight: Any, bias: Any, eps: float) -> Tensor:
        """Layer normalisation over the last dim."""

    def rope(self, x: Tensor, positions: Tensor, *, dims: int, base: float, scale: float = 1.0, neox: bool) -> Tensor:
        """Rotary embedding of x [n, heads, head_dim]; `neox` rotates halves, otherwise adjacent pairs (ggml)."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: Any, layer: int, scale: float) -> Tensor:
        """Write k, v [n, kv_heads, d] into the cache and attend q [n, heads, d] -> [n, heads * dv]."""

    def cached_keys(self, keys: Any, cells: Tensor) -> Tensor:
        """Keys stored in a cache buffer at `cells`, as [n, kv_heads, dim]."""

    def store_keys(self, keys: Any, cells: Tensor, new: Tensor) -> Tensor:
        """Overwrite a cache buffer's keys at `cells` with `new` [n, kv_heads, dim]."""

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor: ...

    def rows(self, x: Tensor, indices: Tensor) -> Tensor:
        """Select rows of a 2-D tensor."""

    def split(self, x: Tensor, sizes: Sequence[int], dim: int = -1) -> tuple[Tensor, ...]:
        """Cut x along `dim` into consecutive parts of `sizes` (a fused QKV projection into q, k, v)."""

    def scale(self, x: Tensor, factor: float) -> Tensor: ...

    def silu(self, x: Tensor) -> Tensor: ...

    def gelu(self, x: Tensor, approximate: str = "tanh") -> Tensor: ...

    def compute(self, *outputs: Tensor) -> list[Any]:
        """Run the graph and return `outputs` as torch tensors on the backend's device."""


class Backend(Protocol):
    """A tensor backend plugin: loads weights, allocates cache buffers, creates contexts."""

    name: str
    device: str
    precision: str

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str) -> Any:
        """Load one GGUF tensor for `role`; raise UnsupportedTensorTypeError for a type it cannot handle."""

    def set_threads(self, count: int) -> None:
        """Use `count` CPU threads for compute."""

    def new_context(self, batch: Any = None) -> Context:
        """A fresh graph-building context; knowing the batch lets a backend keep each sequence's results batch-invariant."""

    def run(self, model: Any, batch: Any, cache: Any) -> Any:
        """`model.forward` for `batch` over a prepared cache view, computed; the logits as a torch tensor.

        A backend may reuse the graph it recorded for an earlier batch of the same size, so a
        model's forward must build the same ops for batches of the same size, with batch values
        entering only through `ctx.input(batch.<field>)`.
        """

    def kv_buffer(self, shape: Sequence[int]) -> Any:
        """A zeroed native buffer for the KV cache."""

    def from_numpy(self, array: np.ndarray) -> Any:
        """A native tensor on the backend's device (cache slots, masks)."""

    def to_numpy(self, value: Any) -> np.ndarray:
        """A computed output as a float32 numpy array."""

    def weight_bytes(self, weight: Any) -> int:
        """Memory a loaded weight occupies."""

    def resident_bytes(self, tensors: Sequence[tuple[TensorInfo, str]]) -> int:
        """Memory loading these (tensor, role) pairs would occupy, without loading them (the scheduler's estimate).

        Raises UnsupportedTensorTypeError, as `load_tensor` would, for a type the backend cannot load.
        """

    def kv_buffer_bytes(self, shape: Sequence[int]) -> int:
        """Memory `kv_buffer(shape)` would occupy."""
