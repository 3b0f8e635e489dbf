"""Tensor parallelism's cut of a model (Megatron-LM's, as vLLM applies it to GQA models).

The q, k, v, gate and up projections are column-parallel: each rank computes some of their output
features (for attention, whole heads) and no communication follows. The attention output and down
projections are row-parallel: each rank multiplies its share of their input features and one
all-reduce sums the partial products. So a block costs two all-reduces of [tokens, hidden].

Query heads split evenly; KV heads split evenly too, or, when there are fewer KV heads than ranks,
each rank holds the one KV head its query heads read (replicated on `world / kv_heads` ranks). The
KV cache holds only the rank's KV heads. Everything else (embeddings, norms, logits, routers and
experts) stays whole on every rank and computes the same values there.

Which layer is which is declared once, by the layer classes of nn.py (`Linear.parallel`,
`Linear.heads`); architecture files do not change.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from corral.errors import CorralError
from corral.gguf import GGUFFile


class TensorParallelError(CorralError, ValueError):
    """The model cannot be split over this many ranks (heads not divisible, an unsupported layer)."""


class RankFailedError(CorralError):
    """A rank of a tensor-parallel model died or stopped answering; the model is unusable until reloaded."""


@attrs.frozen
class Shard:
    """One rank's part of a tensor: part `index` of `parts` equal parts of its "rows" (output
    features) or "columns" (input features)."""

    axis: str
    parts: int
    index: int

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, stop) of this part of `length` items."""
        size = length // self.parts
        return self.index * size, (self.index + 1) * size


def _per_layer(value: Any, layer: int | None) -> int:
    """A head count that a file may store per layer (an array) or once."""
    if isinstance(value, (list, tuple)) or hasattr(value, "__len__"):
        return int(value[layer or 0])
    return int(value)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit() else None


@attrs.frozen(eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel model: its rank of `world`, and the process group
    the all-reduces run over (a torch.distributed ProcessGroup)."""

    rank: int
    world: int
    group: Any = None
    on_failure: Any = None  # rank 0's RankGroup: turns a failed collective into a RankFailedError

    # --- the cut ---------------------------------------------------------------------------
    def shard(self, layer_type: type, gguf: GGUFFile, name: str) -> Shard | None:
        """The part of tensor `name` (bound as `layer_type`) this rank loads; None: all of it."""
        parallel = getattr(layer_type, "parallel", None)
        if parallel == "row":
            return Shard("columns", self.world, self.rank)
        if parallel != "column":
            return None
        if getattr(layer_type, "heads", None) == "q":
            self.local_heads(self._heads(gguf, "head_count", name))
        elif getattr(layer_type, "heads", None) == "kv":
            kv_heads = self._heads(gguf, "head_count_kv", name, fallback="head_count")
            if kv_heads % self.world:
                self.local_kv_heads(kv_heads)  # raises unless the heads are replicated
                return Shard("rows", kv_heads, self.rank // (self.world // kv_heads))
        return Shard("rows", self.world, self.rank)

    def local_heads(self, heads: int) -> int:
        """Query heads on this rank."""
        if heads % self.world:
            raise TensorParallelError(f"tensor_parallel {self.world} does not divide the model's {heads} attention heads; choose a divisor of {heads}")
        return heads // self.world

    def local_kv_heads(self, kv_heads: int) -> int:
        """KV heads on this rank: an even share, or one replicated head when there are fewer heads than ranks."""
        if kv_heads % self.world == 0:
            return kv_heads // self.world
        if self.world % kv_heads == 0:
            return 1
        raise TensorParallelError(
            f"tensor_parallel {self.world} and the model's {kv_heads} KV heads do not fit: one must divide the other"
        )

    def local_attention(self, opt: Any) -> Any:
        """A layer's AttentionOptions (nn.py) for this rank's heads."""
        return attrs.evolve(opt, heads=self.local_heads(opt.heads), kv_heads=self.local_kv_heads(opt.kv_heads))

    def kv_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """A KV cache buffer's shape [kv_heads, cells, dim] for this rank's KV heads."""
        return (self.local_kv_heads(shape[0]), *shape[1:])

    def unsupported(self, what: str) -> TensorParallelError:
        """The error for a model with a layer tensor parallelism cannot split."""
        return TensorParallelError(f"tensor parallelism cannot split {what} yet; load this model with tensor_parallel 1")

    def _heads(self, gguf: GGUFFile, key: str, name: str, fallback: str | None = None) -> int:
        arch = gguf.architecture
        value = gguf.metadata.get(f"{arch}.attention.{key}")
        if value is None and fallback:
            value = gguf.metadata.get(f"{arch}.attention.{fallback}")
        if value is None:
            raise TensorParallelError(f"{gguf.path}: no {arch}.attention.{key} key; tensor parallelism needs the head counts")
        return _per_layer(value, _layer_of(name))

    # --- the communication -------------------------------------------------------------------
    def all_reduce(self, tensor: Any) -> Any:
        """Sum `tensor` over the ranks, in place; returns it."""
        import torch

        wide = tensor if tensor.dtype == torch.float32 else tensor.float()  # gloo sums float32 on every build
        try:
            self.group.allreduce([wide]).wait()
        except RuntimeError as e:  # gloo's "connection closed by peer": a rank died
            if self.on_failure is None:
                raise
            raise self.on_failure(e) from e
        return wide if wide is tensor else wide.to(tensor.dtype)


def check_split(path: Any, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """Refuse, from the GGUF's metadata alone (before any process starts), a split its model cannot take."""
    if tensor_parallel > 1 and pipeline_parallel > 1:
        raise TensorParallelError("tensor_parallel and pipeline_parallel do not combine yet; choose one")
    if tensor_parallel == pipeline_parallel == 1:
        return
    gguf = GGUFFile.open(path)
    try:
        if tensor_parallel > 1:
            check_heads(gguf, tensor_parallel)
        else:
            stage_blocks(int(gguf.metadata[f"{gguf.architecture}.block_count"]), pipeline_parallel, 0)
    finally:
        gguf.close()


# Here, not in pipeline.py (which needs torch): the server checks a split without importing torch.
def stage_blocks(block_count: int, stages: int, stage: int) -> range:
    """The blocks of `stage`: consecutive, as even as they go, the earlier stages taking one more."""
    if not 1 <= stages <= block_count:
        raise TensorParallelError(f"pipeline_parallel {stages} needs between 1 and the model's {block_count} blocks")
    size, extra = divmod(block_count, stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def check_heads(gguf: GGUFFile, world: int) -> None:
    """Refuse, from the metadata alone (before any rank starts), head counts that `world` ranks cannot split."""
    parallel = TensorParallel(0, world)
    arch = gguf.architecture
    heads, kv_heads = gguf.metadata.get(f"{arch}.attention.head_count"), gguf.metadata.get(f"{arch}.attention.head_count_kv")
    if heads is None:
        raise TensorParallelError(f"{gguf.path}: no {arch}.attention.head_count key; tensor parallelism needs the head counts")
    for layer in range(len(heads) if hasattr(heads, "__len__") else 1):
        parallel.local_heads(_per_layer(heads, layer))
        parallel.local_kv_heads(_per_layer(kv_heads if kv_heads is not None else heads, layer))


def check_model(model: Any, parallel: TensorParallel) -> None:
    """Refuse, at load, a model whose blocks are not all nn.Attention blocks tensor parallelism can split."""
    from corral.nn import Attention

    for i, block in enumerate(getattr(model, "blocks", ())):
        attentions = [getattr(block, f.name) for f in attrs.fields(type(block)) if isinstance(getattr(block, f.name), Attention)]
        if len(attentions) != 1:
            raise parallel.unsupported(f"block {i} of {type(model).__name__}, whose attention is not nn.Attention")
        (attention,) = attentions
        if attention.qkv is not None or attention.sinks is not None:
            raise parallel.unsupported("a fused qkv projection or attention sinks")
