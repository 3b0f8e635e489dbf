"""Layers shared by architectures, written against the Context ops of ml.py.

Each layer holds backend weights and says which `role` the binder loads them for.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs


@attrs.frozen
class Linear:
    role: ClassVar[str] = "linear"
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, x: Any) -> Any:
        return ctx.linear(x, self.weight, self.bias)


@attrs.frozen
class Logits(Linear):
    """The final projection to vocabulary logits: backends keep it at full precision."""

    role: ClassVar[str] = "logits"


@attrs.frozen
class Embedding:
    role: ClassVar[str] = "embedding"
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, ids: Any) -> Any:
        return ctx.embedding(self.weight, ids)


@attrs.frozen
class RMSNorm:
    role: ClassVar[str] = "vector"
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, x: Any, eps: float) -> Any:
        return ctx.rms_norm(x, self.weight, eps)


@attrs.frozen
class LayerNorm:
    role: ClassVar[str] = "vector"
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, x: Any, eps: float) -> Any:
        return ctx.layer_norm(x, self.weight, self.bias, eps)
