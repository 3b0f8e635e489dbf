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
from typing import Any, Iterator, Sequence

import attrs
import numpy as np
from gguf import LlamaFileType

from corral.gguf import GGUFFile
from corral.kvcache import CausalCache
from corral.memory import release_freed_memory, reuse_large_buffers
from corral.model import Batch
from corral.registry import Plugins
from corral.template import ChatTemplate
from corral.tokenizer import Tokenizer

DEFAULT_NUM_CTX = 4096


@attrs.frozen
class ModelInfo:
    """What `m.info` reports about a loaded model."""

    architecture: str
    name: str
    parameter_count: int
    quantization: str
    context_length: int
    file_size: int
    load_seconds: float


def quantization_name(gguf: GGUFFile) -> str:
    """The file type as Ollama shows it (`Q4_1`, `Q4_K_M`, `F16`)."""
    file_type = gguf.get("general.file_type")
    if file_type is None:
        return "unknown"
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"type {file_type}"


def parameter_count(gguf: GGUFFile) -> int:
    """Total number of weights in the file."""
    return int(sum(int(np.prod(info.shape)) for info in gguf.tensors.values()))


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
    ):
        self.path = path
        self.gguf = gguf
        self.model = model
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = ChatTemplate.from_metadata(gguf.metadata, model.default_chat_template())
        self.plugins = plugins or Plugins()

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

    def new_cache(self, num_cells: int) -> CausalCache:
        """A KV cache with room for `num_cells` tokens."""
        return CausalCache(self.backend, self.model.cache_layers(), num_cells)

    def compute(self, batch: Batch, cache: CausalCache) -> Any:
        """One forward pass; the backend's native logits of the batch's output rows."""
        return self.backend.run(self.model, batch, cache.prepare(batch))

    def forward(self, batch: Batch, cache: CausalCache) -> np.ndarray:
        """One forward pass; float32 logits of the batch's output rows."""
        return self.backend.to_numpy(self.compute(batch, cache))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] from one forward over `ids` with no cache kept."""
        if not len(ids):
            raise ValueError("logits() needs at least one token")
        return self.forward(Batch.single(ids, all_logits=True), self.new_cache(len(ids)))

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, think: bool | str | None = None) -> list[int]:
        """Token ids of `messages` (and the tools on offer) rendered through the chat template; `think` (None: the
        template's default) sets its thinking switch."""
        extra = {} if think is None else {"think": think}
        ids = self.tokenize(self.template.render(messages, add_generation_prompt=True, tools=tools, **extra), add_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS itself
        return ids

    def prompt_ids(
        self, prompt: str, raw: bool = False, system: str | None = None, context: Sequence[int] = (), think: bool | str | None = None
    ) -> list[int]:
        """A generate request's token ids: `context` (earlier ids), then the prompt as a user turn unless `raw` (`think`
        sets the template's thinking switch).

        BOS is only added at the start of a conversation, never after a `context`.
        """
        if raw:
            ids = self.tokenize(prompt, add_special=not context)
        else:
            system_turn = [{"role": "system", "content": system}] if system else []
            ids = self.chat_ids(system_turn + [{"role": "user", "content": prompt}], think=think)
        return list(context) + ids

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
) -> LoadedModel:
    """Open a GGUF model (a store name such as "smollm2", or a file path) on a backend plugin (the default one unless named).

    `num_thread` > 0 sets the backend's compute threads (process-wide for the torch backend).
    """
    plugins = plugins or Plugins()
    path = resolve_model_path(name_or_path)
    start = time.perf_counter()
    reuse_large_buffers()
    gguf = GGUFFile.open(path)
    model_class = plugins.architecture_for(gguf)
    tensor_backend = plugins.open_backend(backend, device=device, precision=precision)
    if num_thread > 0:
        tensor_backend.set_threads(num_thread)
    # The tokenizer (pure Python, ~1 s for a 262k vocabulary) builds while torch converts weights.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer = pool.submit(Tokenizer.from_gguf, gguf.metadata)
        model = model_class.from_gguf(gguf, tensor_backend)
        tokenizer = tokenizer.result()
    gguf.drop_resident_pages()
    release_freed_memory()
    return LoadedModel(path, gguf, model, tensor_backend, tokenizer, time.perf_counter() - start, plugins)
