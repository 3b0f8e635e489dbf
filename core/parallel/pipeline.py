"""Pipeline parallelism: a decoder's blocks cut into consecutive stages, one process (or host) each.

Stage 0 embeds the batch and runs the first blocks, sends the hidden states [tokens, hidden] to
stage 1, and so on; the last stage norms and projects the output rows and sends their logits back
to stage 0, which samples. Each stage loads only its blocks' weights and holds only their KV cache,
so a model larger than one host's memory runs across several. The transfers are torch.distributed
point-to-point sends in the step's graph (gloo on CPU, NCCL between GPUs); what each step computes, and every cache
change, reaches the stages as tensor parallelism's do (ranks.py, mirror.py).

One batch is in flight at a time (no micro-batches): the stages take turns, so the split buys
memory, not speed. It works for any architecture built on decoder.py's DecoderModel that keeps its
`forward` (embed, blocks in order, logits), which is all of corral's decoders.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from corral.model import CacheLayer
from corral.parallel.shards import TensorParallelError, stage_blocks  # noqa: F401 - stage_blocks: ranks.py imports it from here


@attrs.frozen(eq=False)
class PipelineStage:
    """This process's stage of a pipeline: its rank of `stages`, its blocks and the process group of all stages."""

    rank: int
    stages: int
    blocks: range
    group: Any = None
    on_failure: Any = None  # rank 0's RankGroup: turns a failed transfer into a RankFailedError
    device: Any = None  # this stage's torch.device, where received activations land (NCCL sends from and to GPU memory)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.stages - 1

    def send(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        """Send a 2-D activation to stage `peer` (its shape first); returns it."""
        values = tensor.float().contiguous()
        self._run(self.group.send, [torch.tensor(values.shape, dtype=torch.int64, device=values.device)], peer, 0)
        self._run(self.group.send, [values], peer, 1)
        return tensor

    def receive(self, peer: int, after: Any = None) -> torch.Tensor:
        """The next 2-D activation stage `peer` sends (`after`: a value that must exist first, ordering the graph)."""
        shape = torch.empty(2, dtype=torch.int64, device=self.device)
        self._run(self.group.recv, [shape], peer, 0)
        values = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=self.device)
        self._run(self.group.recv, [values], peer, 1)
        return values

    def _run(self, op: Any, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        try:
            op(tensors, peer, tag).wait()
        except RuntimeError as e:  # gloo's "connection closed by peer": a stage died
            if self.on_failure is None:
                raise
            raise self.on_failure(e) from e


class StageModel:
    """A decoder model as one pipeline stage runs it: its own blocks between a receive and a send."""

    def __init__(self, model: Any, stage: PipelineStage):
        from corral.decoder import DecoderModel

        kind = type(model)
        if not isinstance(model, DecoderModel) or kind.forward is not DecoderModel.forward or kind.blocks_output is not DecoderModel.blocks_output:
            raise TensorParallelError(f"pipeline parallelism runs decoder.py's DecoderModel forward; {kind.__name__} has its own")
        self.model, self.stage = model, stage

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)  # config, pooling, shift_keys, default_chat_template ...

    def cache_layers(self) -> list[CacheLayer]:
        """The model's cache layout, with no KV heads (no memory) in the other stages' layers."""
        layers = self.model.cache_layers()
        return [layer if i in self.stage.blocks else attrs.evolve(layer, kv_heads=0) for i, layer in enumerate(layers)]

    def forward(self, ctx: Any, batch: Any, cache: Any) -> Any:
        model, stage = self.model, self.stage
        positions = ctx.input(batch.positions)
        x = model.embed(ctx, ctx.input(batch.inputs)) if stage.first else ctx.receive(stage.rank - 1)
        for i in stage.blocks:
            x = model.blocks[i](ctx, x, positions, cache, i, model)
        if not stage.last:
            sent = ctx.send(x, stage.rank + 1)
            return ctx.receive(stage.stages - 1, after=sent) if stage.first else sent
        logits = model.logits(ctx, ctx.rows(x, ctx.input(batch.outputs)))
        return logits if stage.first else ctx.send(logits, 0)
