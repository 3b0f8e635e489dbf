"""Layers and blocks shared by architectures, written against the Context ops of ml.py.

Each layer holds backend weights and says which `role` the binder loads them for. The blocks
(Attention, GatedMLP, MLP, MoE) are attrs classes of layers that an architecture binds at a name
pattern with `model.module` and calls with options from its config: an architecture file says
only what differs.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs

from corral.errors import MissingTensorError
from corral.ml import Rope
from corral.model import module, tensor


@attrs.frozen
class Linear:
    role: ClassVar[str] = "linear"
    # How tensor parallelism splits it (core/parallel/shards.py): None keeps it whole on every rank.
    parallel: ClassVar[str | None] = None
    heads: ClassVar[str | None] = None  # "q" or "kv": its output rows are whole heads of that kind
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, x: Any) -> Any:
        return ctx.linear(x, self.weight, self.bias)


@attrs.frozen
class ColumnLinear(Linear):
    """A projection whose output features tensor parallelism splits across ranks (gate, up): each
    rank computes its own share of them, with no communication."""

    parallel: ClassVar[str | None] = "column"


@attrs.frozen
class QueryLinear(ColumnLinear):
    """The query projection: each rank holds whole query heads."""

    heads: ClassVar[str | None] = "q"


@attrs.frozen
class KeyValueLinear(ColumnLinear):
    """A key or value projection: each rank holds whole KV heads (one replicated head when there are fewer heads than ranks)."""

    heads: ClassVar[str | None] = "kv"


@attrs.frozen
class RowLinear(Linear):
    """A projection whose input features tensor parallelism splits (attention output, down): each
    rank multiplies its share and one all-reduce sums the partial products; the bias is added once, after."""

    parallel: ClassVar[str | None] = "row"

    def __call__(self, ctx: Any, x: Any) -> Any:
        if getattr(ctx, "parallel", None) is None:
            return ctx.linear(x, self.weight, self.bias)
        y = ctx.all_reduce(ctx.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


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


@attrs.frozen
class Vector:
    """A loaded vector used as is (Llama 3's rope_freqs, gpt-oss's attention sinks, a routing bias)."""

    role: ClassVar[str] = "vector"
    weight: Any
    bias: Any = None


@attrs.frozen
class Experts:
    """A stack of expert linears [experts, out, in] (+ bias [experts, out]); `ids` picks one per slot."""

    role: ClassVar[str] = "experts"
    weight: Any
    bias: Any = None

    def __call__(self, ctx: Any, x: Any, ids: Any) -> Any:
        return ctx.expert_linear(x, self.weight, ids, self.bias)


# --- activations ------------------------------------------------------------------------------

# gpt-oss's clamped SwiGLU: gate * sigmoid(1.702 gate) * (up + 1), both clamped to +-7 first.
OAI_SWIGLU_ALPHA, OAI_SWIGLU_LIMIT = 1.702, 7.0


def activate(ctx: Any, name: str, x: Any) -> Any:
    """The activation `name` of x: "silu", "gelu" (tanh form), "gelu_erf", "gelu_quick" (x sigmoid(1.702 x), CLIP's), "relu"."""
    if name == "silu":
        return ctx.silu(x)
    if name == "gelu":
        return ctx.gelu(x)
    if name == "gelu_erf":
        return ctx.gelu(x, approximate="none")
    if name == "gelu_quick":
        return x * ctx.sigmoid(ctx.scale(x, 1.702))
    if name == "relu":
        return ctx.relu(x)
    raise ValueError(f"unknown activation {name!r}")


def gated(ctx: Any, name: str, gate: Any, up: Any) -> Any:
    """activation(gate) * up, or gpt-oss's clamped form for "swiglu_oai"."""
    if name == "swiglu_oai":
        gate = ctx.clamp(gate, max=OAI_SWIGLU_LIMIT)
        up = ctx.clamp(up, min=-OAI_SWIGLU_LIMIT, max=OAI_SWIGLU_LIMIT)
        return gate * ctx.sigmoid(ctx.scale(gate, OAI_SWIGLU_ALPHA)) * (up + 1.0)
    return activate(ctx, name, gate) * up


# --- blocks shared by architectures, bound with `module(cls, "attn_{}")` ----------------------


@attrs.frozen
class AttentionOptions:
    """What one layer's attention does, from the architecture's config."""

    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    rope: Rope | None  # None: this layer has no rotary embedding (NoPE)
    scale: float | None = None  # None: 1 / sqrt(key_dim)
    norm_eps: float = 1e-6  # of the q/k norms
    qk_norm: str = "head"  # q/k norms over each head ("head": Qwen 3, Gemma) or over all heads' features ("full": OLMo 2)
    softcap: float | None = None


@attrs.frozen
class Attention:
    """Self-attention: q, k, v (or one fused qkv) projections with optional biases, optional q/k
    norms, RoPE, optional sinks, the output projection."""

    q: Linear = tensor("q", QueryLinear, optional=True)
    k: Linear = tensor("k", KeyValueLinear, optional=True)
    v: Linear = tensor("v", KeyValueLinear, optional=True)
    qkv: Linear = tensor("qkv", Linear, optional=True)  # fused: kept whole under tensor parallelism, which then refuses the model
    output: Linear = tensor("output", RowLinear)
    q_norm: RMSNorm = tensor("q_norm", RMSNorm, optional=True)
    k_norm: RMSNorm = tensor("k_norm", RMSNorm, optional=True)
    sinks: Vector = tensor("sinks", Vector, optional=True)

    def __attrs_post_init__(self) -> None:
        if self.qkv is None and None in (self.q, self.k, self.v):
            raise MissingTensorError("attention needs q, k and v projections or a fused qkv one; the file has neither")

    def __call__(self, ctx: Any, x: Any, positions: Any, cache: Any, layer: int, opt: AttentionOptions) -> Any:
        q, k, v = self.project(ctx, x, positions, opt)
        attn = ctx.attention(
            q, k, v, cache, layer, opt.scale or 1.0 / math.sqrt(opt.key_dim), softcap=opt.softcap, sinks=self.sinks and self.sinks.weight
        )
        return self.output(ctx, attn)

    def project(self, ctx: Any, x: Any, positions: Any, opt: AttentionOptions) -> tuple[Any, Any, Any]:
        """q, k, v as [n, heads, dim], normed and rotated (under tensor parallelism: this rank's heads)."""
        parallel = getattr(ctx, "parallel", None)
        if parallel is not None:
            if self.qkv is not None or self.sinks is not None or (opt.qk_norm == "full" and self.q_norm is not None):
                raise parallel.unsupported("a fused qkv projection, attention sinks or q/k norms over all heads' features")
            opt = parallel.local_attention(opt)
        if self.qkv is not None:
            q, k, v = ctx.split(self.qkv(ctx, x), (opt.heads * opt.key_dim, opt.kv_heads * opt.key_dim, opt.kv_heads * opt.value_dim))
        else:
            q, k, v = self.q(ctx, x), self.k(ctx, x), self.v(ctx, x)
        if opt.qk_norm == "full" and self.q_norm is not None:
            q, k = self.q_norm(ctx, q, opt.norm_eps), self.k_norm(ctx, k, opt.norm_eps)
        q = ctx.reshape(q, (-1, opt.heads, opt.key_dim))
        k = ctx.reshape(k, (-1, opt.kv_heads, opt.key_dim))
        v = ctx.reshape(v, (-1, opt.kv_heads, opt.value_dim))
        if opt.qk_norm == "head" and self.q_norm is not None:
            q, k = self.q_norm(ctx, q, opt.norm_eps), self.k_norm(ctx, k, opt.norm_eps)
        if opt.rope is not None:
            q, k = ctx.rope(q, positions, opt.rope), ctx.rope(k, positions, opt.rope)
        return q, k, v


@attrs.frozen
class GatedMLP:
    """down(act(gate(x)) * up(x)); with no `gate` tensor, `up` holds gate and up side by side (Phi-3)."""

    gate: Linear = tensor("gate", ColumnLinear, optional=True)
    up: Linear = tensor("up", ColumnLinear)
    down: Linear = tensor("down", RowLinear)

    def __call__(self, ctx: Any, x: Any, activation: str = "silu", width: int | None = None) -> Any:
        """`width`: the feed-forward length, needed to cut a fused gate/up projection."""
        if self.gate is None:
            if getattr(ctx, "parallel", None) is not None:
                raise ctx.parallel.unsupported("a fused gate/up projection (Phi-3's)")
            gate, up = ctx.split(self.up(ctx, x), (width, width))
        else:
            gate, up = self.gate(ctx, x), self.up(ctx, x)
        return self.down(ctx, gated(ctx, activation, gate, up))


@attrs.frozen
class MLP:
    """down(act(up(x))), with biases where the file has them (GPT-2, StarCoder 2)."""

    up: Linear = tensor("up", ColumnLinear)
    down: Linear = tensor("down", RowLinear)

    def __call__(self, ctx: Any, x: Any, activation: str = "gelu") -> Any:
        return self.down(ctx, activate(ctx, activation, self.up(ctx, x)))


@attrs.frozen
class MoEOptions:
    """How a mixture-of-experts layer routes, from the architecture's config."""

    experts_used: int
    # "softmax": probabilities over all experts, the top ones chosen (Mixtral, Qwen 3 MoE);
    # "sigmoid": independent scores (DeepSeek V3); "softmax_chosen": the top logits chosen, then
    # a softmax over those alone (gpt-oss).
    gating: str = "softmax"
    normalize: bool = False  # the chosen weights rescaled to sum to 1
    scale: float = 1.0  # the routed experts' output multiplied by it
    activation: str = "silu"
    # Grouped routing (DeepSeek V2/V3): the `experts` split into `groups` equal groups, each scored
    # by the sum of its best `group_top` selection scores; experts are chosen from the best
    # `groups_used` groups only.
    experts: int = 0
    groups: int = 1
    groups_used: int = 1
    group_top: int = 2


@attrs.frozen
class MoE:
    """A router over expert stacks (bound at the file's own names: `ffn_gate_inp`, `ffn_*_exps`,
    `exp_probs_b`), and shared experts where the file has them (`ffn_*_shexp`, gated by
    `ffn_gate_inp_shexp` where it has that)."""

    router: Linear = tensor("ffn_gate_inp", Linear)
    gate: Experts = tensor("ffn_gate_exps", Experts)
    up: Experts = tensor("ffn_up_exps", Experts)
    down: Experts = tensor("ffn_down_exps", Experts)
    selection_bias: Vector = tensor("exp_probs_b", Vector, optional=True, suffix="bias")  # added to scores for choosing only
    shared: GatedMLP | None = module(GatedMLP, "ffn_{}_shexp", optional=True)
    # Where present (Qwen 2 MoE), the shared experts' output is scaled per row by sigmoid(shared_gate(x)).
    shared_gate: Linear = tensor("ffn_gate_inp_shexp", Linear, optional=True)

    def __call__(self, ctx: Any, x: Any, opt: MoEOptions) -> Any:
        weights, ids = self.route(ctx, x, opt)
        k = opt.experts_used
        hidden = gated(ctx, opt.activation, self.gate(ctx, x, ids), self.up(ctx, x, ids))  # [n, k, ff]
        outputs = self.down(ctx, hidden, ids)  # [n, k, dim]
        y = ctx.sum(outputs * ctx.reshape(weights, (-1, k, 1)), dim=1)
        if opt.scale != 1.0:
            y = ctx.scale(y, opt.scale)
        if self.shared is not None:
            shared = self.shared(ctx, x, opt.activation)
            if self.shared_gate is not None:
                shared = shared * ctx.sigmoid(ctx.reshape(self.shared_gate(ctx, x), (-1, 1)))
            y = y + shared
        return y

    def route(self, ctx: Any, x: Any, opt: MoEOptions) -> tuple[Any, Any]:
        """Each row's chosen experts [n, k] and their weights [n, k]."""
        logits = self.router(ctx, x)
        if opt.gating == "softmax_chosen":
            chosen, ids = ctx.top_k(logits, opt.experts_used)
            return ctx.softmax(chosen), ids
        if opt.gating == "softmax":
            scores = ctx.softmax(logits)
        elif opt.gating == "sigmoid":
            scores = ctx.sigmoid(logits)
        else:
            raise ValueError(f"unknown gating {opt.gating!r}")
        selection = scores if self.selection_bias is None else scores + self.selection_bias.weight
        if opt.groups > 1:
            selection = self.best_groups_only(ctx, selection, opt)
        _, ids = ctx.top_k(selection, opt.experts_used)
        weights = ctx.gather(scores, ids)
        if opt.normalize:
            weights = weights / ctx.sum(weights, dim=-1, keepdim=True)
        return weights, ids

    def best_groups_only(self, ctx: Any, selection: Any, opt: MoEOptions) -> Any:
        """`selection` [n, experts] with the experts outside each row's best groups at -inf."""
        grouped = ctx.reshape(selection, (-1, opt.groups, opt.experts // opt.groups))
        best, _ = ctx.top_k(grouped, min(opt.group_top, opt.experts // opt.groups))
        group_scores = ctx.sum(best, dim=-1)  # [n, groups]
        _, kept = ctx.top_k(group_scores, opt.groups_used)
        offsets = ctx.keep_only(group_scores, kept) - group_scores  # 0 for a kept group, -inf for the others
        return ctx.reshape(grouped + ctx.reshape(offsets, (-1, opt.groups, 1)), (-1, opt.experts))
