"""The in-process engine API: load a model and get tokens, logits and text out of it.

    m = corral.load_model("smollm2")            # a store name or a path to a .gguf file
    m.tokenize("text"); m.detokenize(ids); m.logits(ids); m.generate("prompt", max_tokens=32)

The Trio runtime builds on the same pieces (model, backend, cache, tokenizer, template), and
`generate` answers through it (`runner/blocking.py`).
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import attrs
import numpy as np

from corral.errors import CorralError
from corral.gguf import GGUFFile
from corral.kvcache import DEFAULT_KV_CACHE_TYPE, CausalCache
from corral.memory import release_freed_memory, reuse_large_buffers
from corral.model import Batch
from corral.model_info import ModelInfo, parameter_count, quantization_name
from corral.registry import Plugins
from corral.template import ChatTemplate
from corral.images import DecodedImage
from corral.vision import IMAGE_FILLER, ImageEncoder, ImageRun, ProjectorError, image_batch_fields, image_prompt_ids, tag_images

if TYPE_CHECKING:
    from corral.tokenizer import Tokenizer

DEFAULT_NUM_CTX = 4096


def resolve_model_path(name_or_path: str | os.PathLike) -> pathlib.Path:
    """A path to a GGUF file, or the store's file for a model name (pulled when missing)."""
    from corral import store

    return store.ensure_model(str(name_or_path))


class LoadedModel:
    """A model bound to a backend, with its tokenizer and chat template."""

    def __init__(
        self,
        path: pathlib.Path,
        gguf: GGUFFile,
        model: Any,
        backend: Any,
        tokenizer: Tokenizer,
        load_seconds: float,
        plugins: Plugins | None = None,
        ranks: Any = None,
    ):
        self.path = path
        self.ranks = ranks  # the other ranks of a split model (corral.parallel.ranks.RankGroup), None without
        self.gguf = gguf
        self.model = model
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = ChatTemplate.from_metadata(gguf.metadata, model.default_chat_template())
        self.plugins = plugins or Plugins()
        self.vision: ImageEncoder | None = None  # a projector attached with `attach_projector`

        self.info = ModelInfo(
            architecture=gguf.architecture,
            name=str(gguf.get("general.name", path.stem)),
            parameter_count=parameter_count(gguf),
            quantization=quantization_name(gguf),
            context_length=int(model.config.context_length),
            file_size=path.stat().st_size,
            load_seconds=load_seconds,
        )

    def with_template(self, source: str) -> LoadedModel:
        """The same loaded weights rendering chats with `source` (a Jinja chat template or an Ollama Go
        template, e.g. a Modelfile's TEMPLATE) instead of the file's; this model keeps its own template."""
        metadata = {**self.gguf.metadata, "tokenizer.chat_template": source}
        other = copy.copy(self)
        other.template = ChatTemplate.from_metadata(metadata, self.model.default_chat_template())
        return other

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (BOS added when the model wants it and add_special is true)."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids))

    def new_cache(
        self, num_cells: int, window_cells: int | None = None, num_seqs: int | None = None, cache_type: str = DEFAULT_KV_CACHE_TYPE
    ) -> CausalCache:
        """A KV cache with room for `num_cells` tokens (see CausalCache); mirrored on the other ranks of a split model."""
        if self.ranks is None:
            return CausalCache(self.backend, self.model.cache_layers(), num_cells, window_cells, num_seqs, cache_type)
        from corral.parallel.mirror import MirroredCache

        return MirroredCache(self.ranks, self.backend, self.model.cache_layers(), num_cells, window_cells, num_seqs, cache_type)

    def close(self) -> None:
        """Stop the other ranks of a split model (nothing to do for a model in one process)."""
        if self.ranks is not None:
            self.ranks.close()

    def compute(self, batch: Batch, cache: CausalCache) -> Any:
        """One forward pass; the backend's native logits of the batch's output rows."""
        return self.backend.run(self.model, batch, cache.prepare(batch))

    def forward(self, batch: Batch, cache: CausalCache) -> np.ndarray:
        """One forward pass; float32 logits of the batch's output rows."""
        return self.backend.to_numpy(self.compute(batch, cache))

    def logits(self, ids: Sequence[int], images: Sequence[ImageRun] = ()) -> np.ndarray:
        """Logits [len(ids), vocab] from one forward over `ids` with no cache kept; `images` put
        embedding rows in place of the ids they cover."""
        if not len(ids):
            raise ValueError("logits() needs at least one token")
        batch = Batch.single([IMAGE_FILLER if token < 0 else token for token in ids], all_logits=True)  # negative: an image's row
        if images:
            batch = attrs.evolve(batch, **image_batch_fields(images, range(len(ids)), self.model.bidirectional_images))
        return self.forward(batch, self.new_cache(len(ids)))

    def attach_projector(self, path: str | os.PathLike) -> ImageEncoder:
        """Load a vision projector (mmproj) beside this model: images then go through `self.vision`."""
        if self.model.image_markers() is None:
            raise ProjectorError(f"{self.info.architecture} models take no images; the projector {path} cannot be used with {self.path.name}")
        self.vision = ImageEncoder.open(path, self.backend, self.plugins, int(self.model.config.embedding_length))
        return self.vision

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, think: bool | str | None = None) -> list[int]:
        """Token ids of `messages` (and the tools on offer) rendered through the chat template; `think` (None: the
        template's default) sets its thinking switch."""
        extra = {} if think is None else {"think": think}
        messages, images = self._tag_message_images(messages)
        ids = self._text_ids(self.template.render(messages, add_generation_prompt=True, tools=tools, **extra), True, images)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself
        return ids

    def prompt_ids(
        self, prompt: str, raw: bool = False, system: str | None = None, context: Sequence[int] = (),
        images: Sequence[DecodedImage] = (), think: bool | str | None = None,
    ) -> list[int]:
        """A generate request's token ids: `context` (earlier ids), then the prompt as a user turn unless `raw` (`think`
        sets the template's thinking switch).

        BOS is only added at the start of a conversation, never after a `context`. `images` go where
        the prompt's `[img-N]` tags say, or before its text; their rows are placeholder ids (`corral.vision`).
        """
        if raw:
            ids = self._text_ids(tag_images(prompt, len(images)), not context, images)
        else:
            system_turn = [{"role": "system", "content": system}] if system else []
            ids = self.chat_ids(system_turn + [{"role": "user", "content": prompt, "images": list(images)}], think=think)
        return list(context) + ids

    def _text_ids(self, text: str, add_special: bool, images: Sequence[DecodedImage]) -> list[int]:
        """Token ids of a rendered prompt, with `images` in place of their tags."""
        if not images:
            return self.tokenize(text, add_special=add_special)
        if self.vision is None:
            raise ProjectorError(f"{self.path.name} has no vision projector: it cannot take images")
        tokenize = lambda piece, first: self.tokenize(piece, add_special=add_special and first)  # noqa: E731
        return image_prompt_ids(tokenize, text, images, self.model.image_markers(), self.vision.tokens_per_image)

    @staticmethod
    def _tag_message_images(messages: list[dict]) -> tuple[list[dict], list[DecodedImage]]:
        """Messages with their `images` turned into `[img-N]` tags before their text, and those images in order."""
        images: list[DecodedImage] = []
        tagged = []
        for message in messages:
            attached = message.get("images") or ()
            if attached:
                message = {**message, "content": tag_images(message.get("content") or "", len(attached), len(images))}
                images += attached
            tagged.append({key: value for key, value in message.items() if key != "images"})
        return tagged, images

    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        temperature: float = 0.0,
        seed: int | None = None,
        raw: bool = False,
        system: str | None = None,
        num_ctx: int | None = None,
        options: dict | None = None,
        format: str | dict | None = None,
    ) -> Iterator[str]:
        """Stream the continuation of `prompt` (templated as a user turn unless `raw`) as text pieces.

        It runs as one request of a Runtime over this model, as a server request would: `options` are
        Ollama's (`stop`, `top_k`, ...; `max_tokens`, `temperature` and `seed`, None for random, win over
        them) and `format` ("json" or a JSON schema) constrains the answer. Not from inside a Trio task
        (use `corral.Runtime` there).
        """
        from corral.runner.blocking import BlockingRuntime  # the runtime is built on this module

        given = {**(options or {}), "num_predict": max_tokens, "temperature": temperature, "seed": -1 if seed is None else seed}
        with BlockingRuntime(self, num_ctx=num_ctx or given.get("num_ctx") or DEFAULT_NUM_CTX) as runtime:
            for chunk in runtime.generate(prompt, given, raw=raw, system=system, format=format):
                if chunk.text:
                    yield chunk.text


def load_model(
    name_or_path: str | os.PathLike,
    precision: str = "auto",
    backend: str | None = None,
    device: str | None = None,
    plugins: Plugins | None = None,
    num_thread: int = 0,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    master: tuple[str, int] | None = None,
    parallel: Any = None,
    stage: Any = None,
    projector: str | os.PathLike | None = None,
) -> LoadedModel:
    """Open a GGUF model (a store name such as "smollm2", or a file path) on a backend plugin (the default one unless named).

    `num_thread` > 0 sets the backend's compute threads (process-wide for the torch backend).
    `tensor_parallel` > 1 splits every layer over that many processes, `pipeline_parallel` > 1 the
    blocks into that many stages (corral.parallel): this process is rank 0 and starts the others,
    or, with `master` (MASTER_ADDR, MASTER_PORT), waits there for ranks started on other hosts;
    `close()` stops them. `parallel` / `stage` are a rank's own place in such a split
    (corral.parallel), given by the rank processes themselves.
    `projector`: a vision projector (mmproj) file to attach (not with a split yet).
    """
    if tensor_parallel > 1 or pipeline_parallel > 1:
        if projector is not None:
            raise CorralError("a model with a vision projector cannot be split over processes yet (tensor_parallel, pipeline_parallel)")
        if tensor_parallel > 1 and pipeline_parallel > 1:
            from corral.parallel.shards import check_split

            check_split(name_or_path, tensor_parallel, pipeline_parallel)  # raises: they do not combine
        split, world = ("tensor", tensor_parallel) if tensor_parallel > 1 else ("pipeline", pipeline_parallel)
        return _load_split(name_or_path, split, world, master, precision, backend, device, plugins, num_thread)
    plugins = plugins or Plugins()
    path = resolve_model_path(name_or_path)
    start = time.perf_counter()
    reuse_large_buffers()
    gguf = GGUFFile.open(path)
    model_class = plugins.architecture_for(gguf)
    tensor_backend = plugins.open_backend(backend, device=device, precision=precision)
    if num_thread > 0:
        tensor_backend.set_threads(min(num_thread, os.cpu_count() or 1))  # more threads than cores only contend
    # Before any tensor loads: the binder asks `parallel` for each layer's shard; graphs send through `stage`.
    tensor_backend.parallel, tensor_backend.stage = parallel, stage
    # The tokenizer (pure Python, ~1 s for a 262k vocabulary) builds while torch converts weights. Imported here: the
    # routing server imports this module for ModelInfo and must not map the tokenizers library (see memory in BENCHMARKS.md).
    from corral.tokenizer import Tokenizer

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer = pool.submit(Tokenizer.from_gguf, gguf.metadata)
        model = model_class.from_gguf(gguf, tensor_backend, blocks=stage and stage.blocks)
        tokenizer = tokenizer.result()
    if parallel is not None:
        from corral.parallel.shards import check_model

        check_model(model, parallel)
    if stage is not None:
        from corral.parallel.pipeline import StageModel

        model = StageModel(model, stage)
    gguf.drop_resident_pages()
    release_freed_memory()
    loaded = LoadedModel(path, gguf, model, tensor_backend, tokenizer, time.perf_counter() - start, plugins)
    if projector is not None:
        loaded.attach_projector(projector)
    return loaded


def _load_split(
    name_or_path: str | os.PathLike,
    split: str,
    world: int,
    master: tuple[str, int] | None,
    precision: str,
    backend: str | None,
    device: str | None,
    plugins: Plugins | None,
    num_thread: int,
) -> LoadedModel:
    """Rank 0's load of a model split over `world` processes: start (or await) the other ranks, load this rank's part, wait for theirs."""
    from corral.parallel.ranks import RankGroup
    from corral.parallel.shards import check_split

    start = time.perf_counter()
    path = resolve_model_path(name_or_path)
    check_split(path, **{f"{split}_parallel": world})  # a split that cannot work fails before any process starts
    # Tensor-parallel ranks compute at once: by default they share the cores rather than each taking all of them.
    threads = num_thread or (max(1, (os.cpu_count() or 1) // world) if split == "tensor" and master is None else 0)
    load = dict(name_or_path=str(path), precision=precision, backend=backend, device=device, num_thread=threads)
    ranks = RankGroup(world, load, split, master)
    try:
        loaded = load_model(path, precision, backend, ranks.device, plugins, threads, **ranks.role)  # on CUDA: rank 0's GPU
        ranks.wait_loaded()
    except BaseException:
        ranks.close()
        raise
    loaded.ranks = ranks
    loaded.info = attrs.evolve(loaded.info, load_seconds=time.perf_counter() - start)
    return loaded
