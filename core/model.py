"""The contract between the runtime and an architecture plugin.

An architecture is a class with:
* `Config`: an attrs class whose fields name their GGUF keys (`gguf_key("block_count")` reads
  `<arch>.block_count`), built by `config_from_gguf`;
* tensor fields bound by GGUF name (`tensor("attn_q")` in a block reads `blk.{i}.attn_q.weight`),
  and module fields binding a shared block of nn.py under a name pattern (`module(Attention,
  "attn_{}")` binds its `q` to `attn_q`, like Ollama's nested structs), built by `TensorBinder`;
* `forward(ctx, batch, cache)` that only builds ops against the backend context and returns the
  logits of the rows in `batch.outputs`;
* `cache_layout(config)` describing the KV cache it needs (one `CacheLayer` per block), from the
  config alone, so the scheduler can size a model before loading it (`tensor_plan` does the same
  for the weights);
* optionally `default_chat_template()`, for files of the architecture that carry no template.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import attrs
import numpy as np
from corral.ggml_types import GGMLQuantizationType

from corral.errors import GGUFError, MissingTensorError, UnsupportedTensorTypeError
from corral.gguf import GGUFFile, TensorInfo

_GGUF_KEY = "corral.gguf_key"
_TENSOR = "corral.tensor"
_MODULE = "corral.module"


@attrs.frozen
class Batch:
    """One forward pass: a token per row, its position and sequence, and which rows give logits."""

    inputs: np.ndarray  # int64 [n] token ids
    positions: np.ndarray  # int64 [n]
    sequences: np.ndarray  # int64 [n]
    outputs: np.ndarray  # int64 [k] row indices whose logits are returned, in this order
    # Images: float rows [m, dim] (numpy, or tensors the backend computed) that replace the token
    # embeddings of rows `embedding_rows` [m]; rows sharing a `blocks` id >= 0 (one image's) attend
    # to each other both ways, as Gemma 3's image tokens do; -1 (and no `blocks`): causal.
    embeddings: Any = None
    embedding_rows: np.ndarray | None = None
    blocks: np.ndarray | None = None

    @classmethod
    def single(cls, tokens: Sequence[int], start: int = 0, seq: int = 0, all_logits: bool = False) -> Batch:
        """A batch of one sequence's tokens at consecutive positions from `start`."""
        n = len(tokens)
        outputs = np.arange(n) if all_logits else np.array([n - 1])
        return cls(
            np.asarray(tokens, dtype=np.int64),
            np.arange(start, start + n, dtype=np.int64),
            np.full(n, seq, dtype=np.int64),
            outputs.astype(np.int64),
        )

    def __len__(self) -> int:
        return len(self.inputs)


@attrs.frozen
class CacheLayer:
    """What one layer keeps in the KV cache; `window` is the sliding window, None for global attention."""

    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None


def gguf_key(key: str, default: Any = attrs.NOTHING, converter: Any = None) -> Any:
    """An attrs field read from the GGUF key `<arch>.<key>`."""
    return attrs.field(default=default, converter=converter, metadata={_GGUF_KEY: key})


def config_from_gguf(config_cls: type, gguf: GGUFFile, arch: str) -> Any:
    """Build an architecture's attrs config from its `<arch>.*` keys (missing keys take field defaults)."""
    values = {}
    for field in attrs.fields(config_cls):
        key = field.metadata.get(_GGUF_KEY)
        if key is None:
            continue
        full = f"{arch}.{key}" if not key.startswith(("general.", "tokenizer.")) else key
        if full in gguf.metadata:
            values[field.name] = gguf.metadata[full]
        elif field.default is attrs.NOTHING:
            raise GGUFError(f"{gguf.path}: metadata key '{full}' is missing; the {arch} architecture needs it")
    return config_cls(**values)


def tensor(name: str, layer: type, *, fallback: str | None = None, optional: bool = False, suffix: str = "weight") -> Any:
    """A field holding a `layer` (nn.Linear, nn.RMSNorm, ...) bound to the GGUF tensor `name`.

    Inside a block the binder prefixes `blk.{i}.`; `fallback` names the tensor to use when `name`
    is absent (`output` -> `token_embd` for tied embeddings). The layer's main tensor is
    `<name>.<suffix>` (`weight`; a few files store a lone `bias`), and `<name>.bias` its bias.
    """
    return attrs.field(default=None, metadata={_TENSOR: (name, layer, fallback, optional, suffix)})


def module(cls: type, names: str = "{}", *, optional: bool = False) -> Any:
    """A field holding `cls` (an attrs class with tensor fields: nn.Attention, nn.GatedMLP, ...) bound
    with each of its tensor names put into the pattern `names` (`"attn_{}"`: `q` -> `attn_q`).

    An optional module is None when none of its tensors is in the file (shared experts, say).
    """
    return attrs.field(default=None, metadata={_MODULE: (cls, names, optional)})


def bound_layers(obj: Any) -> list[Any]:
    """Every layer (nn.Linear, nn.RMSNorm, ...) bound into `obj` and the modules inside it; a
    model's own and its blocks'."""
    found = []
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        if value is None:
            continue
        if _TENSOR in field.metadata:
            found.append(value)
        elif _MODULE in field.metadata:
            found += bound_layers(value)
    for block in getattr(obj, "blocks", ()) if isinstance(obj, Model) else ():
        if block is not None:
            found += bound_layers(block)
    return found


@attrs.define
class TensorBinder:
    """Loads the tensors a model declares, once each, through the backend (None: only plans them)."""

    gguf: GGUFFile
    backend: Any
    loaded: dict[tuple, Any] = attrs.field(factory=dict)  # (GGUF name, role[, shard]) -> the backend's tensor

    def bind(self, cls: type, prefix: str = "", names: str = "{}", **extra: Any) -> Any:
        """Instantiate `cls`, loading every `tensor(...)` field from `prefix + names.format(name)`
        and binding every `module(...)` field with its pattern nested in `names`."""
        values = dict(extra)
        for field in attrs.fields(cls):
            if _TENSOR in field.metadata:
                name, layer_type, fallback, optional, suffix = field.metadata[_TENSOR]
                full = prefix + names.format(name)
                values[field.name] = self.layer(layer_type, full, fallback and prefix + names.format(fallback), optional, suffix)
            elif _MODULE in field.metadata:
                child, child_names, optional = field.metadata[_MODULE]
                nested = names.format(child_names)
                if optional and not self._any_present(child, prefix, nested):
                    values[field.name] = None
                else:
                    values[field.name] = self.bind(child, prefix, nested)
        return cls(**values)

    def layer(self, layer_type: Any, name: str, fallback: str | None, optional: bool, suffix: str = "weight") -> Any:
        """A layer module (Linear, RMSNorm, ...) built from `<name>.<suffix>` and, if present, `<name>.bias`."""
        found = self._first_present(name, fallback, suffix)
        if found is None:
            if optional:
                return None
            raise MissingTensorError(
                f"{self.gguf.path}: tensor '{name}.{suffix}' is missing"
                + (f" (and so is its fallback '{fallback}.{suffix}')" if fallback else "")
                + "; the file does not match its architecture"
            )
        # Under tensor parallelism a split layer loads this rank's part; a column-split bias is cut
        # with its rows, a row-split layer's bias stays whole (added once, after the all-reduce).
        parallel = getattr(self.backend, "parallel", None)
        shard = parallel.shard(layer_type, self.gguf, found) if parallel is not None else None
        weight = self._load(f"{found}.{suffix}", layer_type.role, shard)
        bias_name = f"{found}.bias"
        bias_shard = shard if shard is not None and shard.axis == "rows" else None
        bias = self._load(bias_name, "vector", bias_shard) if bias_name in self.gguf.tensors and suffix != "bias" else None
        return layer_type(weight, bias)

    def _first_present(self, name: str, fallback: str | None, suffix: str = "weight") -> str | None:
        for candidate in (name, fallback):
            if candidate and f"{candidate}.{suffix}" in self.gguf.tensors:
                return candidate
        return None

    def _any_present(self, cls: type, prefix: str, names: str) -> bool:
        """Whether any tensor `cls` (or a module inside it) declares is in the file."""
        for field in attrs.fields(cls):
            if _TENSOR in field.metadata:
                name, _, fallback, _, suffix = field.metadata[_TENSOR]
                if self._first_present(prefix + names.format(name), fallback and prefix + names.format(fallback), suffix):
                    return True
            elif _MODULE in field.metadata:
                child, child_names, _ = field.metadata[_MODULE]
                if self._any_present(child, prefix, names.format(child_names)):
                    return True
        return False

    def _load(self, full_name: str, role: str, shard: Any = None) -> Any:
        key = (full_name, role) if shard is None else (full_name, role, shard)
        if key not in self.loaded:
            info = self.gguf.tensors[full_name]
            if self.backend is None:
                self.loaded[key] = None
            elif shard is None:
                self.loaded[key] = self.backend.load_tensor(self.gguf, info, role)
            else:
                self.loaded[key] = self.backend.load_tensor(self.gguf, info, role, shard=shard)
        return self.loaded[key]


def check_binds(model_class: type[Model], gguf: GGUFFile) -> None:
    """Raise a CorralError unless `gguf` binds to `model_class`, reading no weight: its metadata builds the
    config, every tensor the architecture needs is present with a known type, and the embedding table is
    `embedding_length` wide with one row per vocabulary token (what loading would find out later)."""
    arch = gguf.architecture
    try:
        plan = model_class.tensor_plan(gguf)
    except (TypeError, ValueError) as error:  # a metadata value of the wrong type, caught by the config class
        raise GGUFError(f"{gguf.path}: the {arch} metadata is unusable: {error}") from None
    for info, _ in plan:
        if not isinstance(info.qtype, GGMLQuantizationType):
            raise UnsupportedTensorTypeError(f"{gguf.path}: tensor '{info.name}' has unknown GGML type {info.qtype}")
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        return
    tokens = gguf.get("tokenizer.ggml.tokens", ())
    width, vocab = gguf.get(f"{arch}.embedding_length"), len(tokens) if isinstance(tokens, list) else 0
    if isinstance(width, int) and embedding.shape[1] != width:
        raise GGUFError(f"{gguf.path}: token_embd.weight is {embedding.shape[1]} wide but {arch}.embedding_length is {width}")
    if vocab and embedding.shape[0] != vocab:
        raise GGUFError(f"{gguf.path}: token_embd.weight has {embedding.shape[0]} rows but the vocabulary has {vocab} tokens")


class Model:
    """Base class of architecture plugins.

    A subclass names its `architecture`, its `Config` and its `Block` (bound once per
    `blk.{i}.`), and declares its top-level tensors as fields; `from_gguf` does the rest.
    """

    Config: ClassVar[type]
    Block: ClassVar[type]
    architecture: ClassVar[str]

    config: Any

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, backend: Any, blocks: range | None = None) -> Model:
        """Build the config from metadata and bind the tensors through the backend.

        `blocks`: bind only these blocks, the others None (a pipeline stage's share of the model).
        """
        return cls._bind(gguf, TensorBinder(gguf, backend), blocks)

    @classmethod
    def tensor_plan(cls, gguf: GGUFFile) -> list[tuple[TensorInfo, str]]:
        """Each GGUF tensor the model would load and the role it is loaded for, without loading any.

        Raises what binding raises (missing metadata keys or tensors), so a file checked here binds.
        """
        binder = TensorBinder(gguf, None)
        cls._bind(gguf, binder)
        return [(gguf.tensors[key[0]], key[1]) for key in binder.loaded]

    @classmethod
    def _bind(cls, gguf: GGUFFile, binder: TensorBinder, only: range | None = None) -> Model:
        config = config_from_gguf(cls.Config, gguf, cls.architecture)
        blocks = tuple(binder.bind(cls.Block, f"blk.{i}.") if only is None or i in only else None for i in range(config.block_count))
        return binder.bind(cls, config=config, blocks=blocks)

    @classmethod
    def default_chat_template(cls) -> str | None:
        """The Jinja chat template for files of this architecture that carry none; None means ChatML."""
        return None

    # Whether one image's embedding rows attend to each other both ways (Gemma 3) rather than causally.
    bidirectional_images: ClassVar[bool] = False

    @classmethod
    def image_markers(cls) -> tuple[str, str] | None:
        """The text before and after an image's embedding rows in a prompt; None: the architecture takes no images."""
        return None

    @classmethod
    def cache_layout(cls, config: Any) -> list[CacheLayer]:
        """One CacheLayer per block, from the config alone."""
        raise NotImplementedError

    def cache_layers(self) -> list[CacheLayer]:
        """One CacheLayer per block of this model."""
        return self.cache_layout(self.config)

    def forward(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        """Build the graph for `batch` and return the logits of `batch.outputs` rows [k, vocab]."""
        raise NotImplementedError

    # llama.cpp's LLAMA_POOLING_TYPE_* as `<arch>.pooling_type` stores them; None: the model does not embed.
    POOLING_TYPES: ClassVar[dict[int, str | None]] = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}

    @property
    def pooling(self) -> str | None:
        """How an embedding pools this model's hidden states ("mean", "cls", "last"), from the file; None: it does not embed."""
        return self.POOLING_TYPES.get(int(getattr(self.config, "pooling_type", 0) or 0))

    @property
    def generates(self) -> bool:
        """Whether the model predicts tokens (a decoder); an encoder only embeds."""
        return bool(self.cache_layers())

    def hidden_states(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        """The final hidden states of the `batch.outputs` rows [k, dim], the rows an embedding pools."""
        raise NotImplementedError(f"{type(self).__name__} does not give hidden states for embeddings")

    def shift_keys(self, ctx: Any, layer: int, keys: Any, delta: Any) -> Any:
        """Re-rotate cached keys [n, kv_heads, dim] of `layer` by `delta` positions (context shift)."""
        raise NotImplementedError(f"{type(self).__name__} cannot shift its cache; generation ends at num_ctx")
