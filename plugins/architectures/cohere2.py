"""Cohere 2 (Command R7B, Command A): Command R's parallel block, with sliding-window attention on
3 of every 4 layers; only the sliding layers rotate q and k, the global ones have no position
encoding.
"""

from __future__ import annotations

import attrs

from corral.hookspecs import hookimpl
from corral.plugins.architectures.command_r import CommandRModel

SLIDING_PATTERN = 4  # layers i with i % 4 < 3 slide


@hookimpl
def register_architectures(register):
    register("cohere2", Cohere2Model)


@attrs.frozen
class Cohere2Model(CommandRModel):
    architecture = "cohere2"

    @classmethod
    def is_sliding(cls, cfg, layer: int) -> bool:
        return layer % SLIDING_PATTERN < SLIDING_PATTERN - 1

    def rope(self, layer: int):
        return super().rope(layer) if self.is_sliding(self.config, layer) else None
