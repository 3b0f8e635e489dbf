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

import attrs
import numpy as np

from corral.gguf import GGUFFile, TensorInfo

# Roles a backend loads a tensor for; each may get its own layout (packed int4 for "linear", ...).
# "experts": a 3-D [experts, out, in] stack of linears, kept packed, of which `expert_linear` reads
# only the selected ones.
ROLES = ("linear", "logits", "embedding", "vector", "experts")


@attrs.frozen
class Yarn:
    """YaRN's frequency blend (ggml's rope_yarn): low frequencies interpolated, high ones kept."""

    original_context: int  # the context the model was trained with
    ext_factor: float = 1.0  # how much of the blend applies (0: plain interpolation)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # The ramp's ends rounded outward to whole pairs, as ggml always does; gpt-oss was trained
    # without the rounding (transformers' `truncate: false`), which no GGUF key records.
    truncate: bool = True


@attrs.frozen
class Rope:
    """How one layer rotates q and k; `ctx.rope(x, positions, rope)`.

    The angle of feature pair i at position p is p * scale * base^(-2i/dims) / freq_factors[i];
    cos and sin are multiplied by `attn_factor` (YaRN's and LongRoPE's magnitude correction).
    """

    dims: int  # leading features that rotate; the rest pass through
    base: float
    scale: float = 1.0  # 1 / linear scaling factor
    neox: bool = False  # rotate halves (NeoX) rather than adjacent pairs (ggml's default)
    freq_factors: Any = attrs.field(default=None, eq=False)  # a loaded vector [dims/2] (Llama 3's rope_freqs, LongRoPE's factors)
    attn_factor: float = 1.0
    yarn: Yarn | None = None
    # Turn only, at magnitude 1 whatever attn_factor and YaRN say: re-rotating cached keys (a
    # context shift), which kept the magnitude from when they were first rotated.
    rotation_only: bool = False
    # LongRoPE (Phi-3): these factors replace `freq_factors` when the cache the graph runs over holds
    # more than `original_context` positions per sequence (llama.cpp's choice, by context length).
    long_factors: Any = attrs.field(default=None, eq=False)
    original_context: int = 0


class Tensor(Protocol):
    """A node of the graph being built; `+ - * /` are elementwise (with broadcasting) over nodes or Python numbers."""

    def __add__(self, other: Tensor | float) -> Tensor: ...

    def __sub__(self, other: Tensor | float) -> Tensor: ...

    def __mul__(self, other: Tensor | float) -> Tensor: ...

    def __truediv__(self, other: Tensor | float) -> Tensor: ...


class Context(Protocol):
    """Graph-building ops; nothing runs until `compute()`.

    `parallel` is None, or this process's rank of a tensor-parallel model (corral.parallel.shards.
    TensorParallel): nn.py's split layers then build their rank's share and `all_reduce` the sums.
    """

    parallel: Any

    def input(self, values: np.ndarray) -> Tensor:
        """An integer input (token ids, positions, row indices)."""

    def float_input(self, values: Any) -> Tensor:
        """A float32 input: image pixels, or embeddings (numpy, or a tensor this backend computed) that replace token rows."""

    def put_rows(self, x: Tensor, indices: Tensor, rows: Tensor) -> Tensor:
        """x [n, dim] with rows `indices` [k] replaced by `rows` [k, dim] (image embeddings in a prompt's rows)."""

    def conv2d(self, x: Tensor, weight: Any, bias: Any, stride: int) -> Tensor:
        """A 2-D convolution of x [channels, height, width] by a loaded weight [out, channels, kh, kw] -> [out, h', w']
        (a vision encoder's patch embedding: kernel and stride the patch size)."""

    def permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        """x with its dims reordered (torch.permute)."""

    def matmul(self, x: Tensor, weight: Any) -> Tensor:
        """x @ weight for a loaded "vector" weight [in, out] stored untransposed (Gemma 3's image projection)."""

    def embedding(self, weight: Any, ids: Tensor) -> Tensor:
        """Rows of an embedding table: [n] -> [n, dim]."""

    def linear(self, x: Tensor, weight: Any, bias: Any = None) -> Tensor:
        """x @ weight.T (+ bias) with the weight in whatever layout the backend loaded it."""

    def rms_norm(self, x: Tensor, weight: Any, eps: float) -> Tensor:
        """RMS normalisation over the last dim, times weight (the file's weight, used as is)."""

    def layer_norm(self, x: Tensor, weight: Any, bias: Any, eps: float) -> Tensor:
        """Layer normalisation over the last dim, times weight, plus bias (None: no bias).

        A weight (and bias) of [heads, dim] for x [n, heads, dim] gives each head its own (Command R+'s q/k norms).
        """

    def rope(self, x: Tensor, positions: Tensor, rope: Rope) -> Tensor:
        """Rotary embedding of x [n, heads, head_dim] as `rope` says.

        With `rope.long_factors`, the factors follow the context of the cache view the graph runs
        over in `Backend.run`, looked up each time it runs; a graph built outside it (a context
        shift's) rotates with `freq_factors`.
        """

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, cache: Any, layer: int, scale: float, *, softcap: float | None = None, sinks: Any = None
    ) -> Tensor:
        """Write k, v [n, kv_heads, d] into the cache and attend q [n, heads, d] -> [n, heads * dv].

        `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
        `sinks`: a loaded vector [heads] of per-head logits that join each row's softmax without a
        value (gpt-oss's attention sinks).
        """

    def bidirectional_attention(self, q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int], scale: float) -> Tensor:
        """Encoder attention without a cache: q, k, v [n, heads, d] hold consecutive runs of `lengths`
        rows, one run per sequence, and each row attends to every row of its own run -> [n, heads * dv]."""

    def all_reduce(self, x: Tensor) -> Tensor:
        """x summed over the ranks of a tensor-parallel model (only called when `parallel` is set)."""

    def send(self, x: Tensor, peer: int) -> Tensor:
        """Send a 2-D activation to pipeline stage `peer` (the backend's `stage`); returns x."""

    def receive(self, peer: int, after: Tensor | None = None) -> Tensor:
        """The 2-D activation pipeline stage `peer` sends next, received once `after` is computed."""

    def cached_keys(self, keys: Any, cells: Tensor) -> Tensor:
        """Keys stored in a cache buffer at `cells`, as [n, kv_heads, dim]."""

    def store_keys(self, keys: Any, cells: Tensor, new: Tensor) -> Tensor:
        """Overwrite a cache buffer's keys at `cells` with `new` [n, kv_heads, dim]."""

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor: ...

    def rows(self, x: Tensor, indices: Tensor) -> Tensor:
        """Select rows of a 2-D tensor."""

    def split(self, x: Tensor, sizes: Sequence[int], dim: int = -1) -> tuple[Tensor, ...]:
        """Cut x along `dim` into consecutive parts of `sizes` (a fused QKV projection into q, k, v)."""

    def concat(self, xs: Sequence[Tensor], dim: int = -1) -> Tensor: ...

    def expand(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """Broadcast size-1 dims of x to `shape` (-1 keeps a dim)."""

    def scale(self, x: Tensor, factor: float) -> Tensor: ...

    def silu(self, x: Tensor) -> Tensor: ...

    def gelu(self, x: Tensor, approximate: str = "tanh") -> Tensor:
        """GELU; `approximate="none"` is the exact erf form."""

    def relu(self, x: Tensor) -> Tensor: ...

    def sigmoid(self, x: Tensor) -> Tensor: ...

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax over the last dim, in float32."""

    def softcap(self, x: Tensor, cap: float) -> Tensor:
        """cap * tanh(x / cap) (Gemma 2's final logits)."""

    def clamp(self, x: Tensor, min: float | None = None, max: float | None = None) -> Tensor: ...

    def sum(self, x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor: ...

    def top_k(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k largest values along the last dim, descending, and their indices (routing over expert scores)."""

    def gather(self, x: Tensor, indices: Tensor) -> Tensor:
        """x's values at `indices` along the last dim (the chosen experts' scores)."""

    def expert_linear(self, x: Tensor, experts: Any, ids: Tensor, bias: Any = None) -> Tensor:
        """ggml's mul_mat_id: for each row r and slot j, x[r] (or x[r, j] when x is [n, k, in]) times
        expert ids[r, j] of a loaded "experts" weight [experts, out, in] (+ bias[ids[r, j]]) -> [n, k, out].

        Only the selected experts' weights are read.
        """

    def stacked_linear(self, x: Tensor, weights: Any) -> Tensor:
        """x [n, k, in] with slot j through matrix j of a loaded "experts" stack [k, out, in] -> [n, k, out]
        (ggml's mul_mat over a 3-D weight: per-head projections such as MLA's k_b and v_b)."""

    def keep_only(self, x: Tensor, indices: Tensor, fill: float = float("-inf")) -> Tensor:
        """x with every entry along the last dim that `indices` [.., k] does not name set to `fill`
        (the expert groups a router may choose from)."""

    def compute(self, *outputs: Tensor) -> list[Any]:
        """Run the graph and return `outputs` as torch tensors on the backend's device."""


class Backend(Protocol):
    """A tensor backend plugin: loads weights, allocates cache buffers, creates contexts."""

    name: str
    device: str
    precision: str
    parallel: Any  # None, or the TensorParallel rank this backend loads and computes for (set before loading)
    stage: Any  # None, or the PipelineStage whose sends and receives this backend's graphs run

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str, shard: Any = None) -> Any:
        """Load one GGUF tensor for `role`; raise UnsupportedTensorTypeError for a type it cannot handle.

        `shard` (a corral.parallel.shards.Shard, only passed under tensor parallelism): load only
        that part of its rows or columns.
        """

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

    def kv_buffer(self, shape: Sequence[int], cache_type: str = "f16") -> Any:
        """A zeroed native buffer for the KV cache [kv_heads, cells, dim]; under tensor parallelism, of the rank's KV heads.

        `cache_type` is one of corral.options.KV_CACHE_TYPES: "f16" (16-bit floats), or ggml's "q8_0" / "q4_0"
        blocks; corral.kvcache.UnsupportedKVCacheTypeError where the backend cannot hold these shapes that way."""

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

    def kv_buffer_bytes(self, shape: Sequence[int], cache_type: str = "f16") -> int:
        """Memory `kv_buffer(shape, cache_type)` would occupy; raises as `kv_buffer` would for a type these shapes cannot take."""

    def compute_overhead_bytes(self) -> int:
        """Optional: memory its first computations take beyond tensors and buffers (kernels' code pages); 0 if absent."""
