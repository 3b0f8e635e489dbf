"""Where a chat's answers come from: a running server (over /api/chat), or a model loaded in this process."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

from corral.runner.wire import images_to_json
from corral.cli.display import PullProgress, err_console
from corral.client import Client, ServerError
from corral.modelfile.defaults import ModelDefaults, format_parameters, model_defaults


class ThinkingText(str):
    """A piece of the model's thinking (not its answer), as a chat backend streams it."""


def running_server() -> Client | None:
    """A client for the server at CORRAL_HOST, or None when none answers there."""
    client = Client()
    if client.is_running():
        return client
    client.close()
    return None


def chat_backend(model: str, keep_alive: str | None, fmt: Any, precision: str, preload: bool, num_ctx: int | None = None) -> ServerChat | LocalChat:
    """The server's chat when one runs (pulling the model there if needed), else the model loaded here."""
    # A .gguf path is not a name the server can load, so it always runs in-process.
    is_file = pathlib.Path(model).is_file() or model.endswith(".gguf")
    client = None if is_file else running_server()
    if client is not None:
        if precision != "auto":
            err_console.print("[yellow]--precision applies in-process only; the server chooses its own[/yellow]")
        backend = ServerChat(client, model, keep_alive, fmt)
        backend.ensure_pulled()
        if preload:
            with err_console.status("loading"):
                client.load(model, keep_alive)
        return backend
    if is_file:
        return LocalChat(model, ModelDefaults(), fmt, precision, num_ctx)
    from corral import store

    pull_in_process_if_missing(model)
    models = store.default_store()
    projector = models.projector_path(model)
    return LocalChat(
        str(models.model_path(model)), model_defaults(models, model), fmt, precision, num_ctx, name=model, projector=projector and str(projector)
    )


def pull_in_process_if_missing(model: str) -> None:
    """Pull `model` into this machine's store, showing progress, unless it is there."""
    from corral import store

    if store.default_store().manifest(model) is None:
        with PullProgress() as progress:
            store.pull(model, progress=progress.report)


class ServerChat:
    """Chat turns answered by a running server over /api/chat."""

    def __init__(self, client: Client, model: str, keep_alive: str | None, fmt: Any):
        self.client = client
        self.model = model
        self.keep_alive = keep_alive
        self.format = fmt
        self.think: bool | str | None = None  # None: the model's default
        self.metrics: dict = {}

    def ensure_pulled(self) -> None:
        """Pull the model into the server's store when it is not there yet, as `ollama run` does."""
        try:
            self.client.show(self.model)
        except ServerError as exc:
            if exc.status != 404:
                raise
            with PullProgress() as progress:
                for event in self.client.pull(self.model):
                    progress.report(event)

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        """The reply's text pieces; `metrics` holds the final chunk's figures afterwards."""
        messages = [{**m, "images": images_to_json(m["images"])} if m.get("images") else m for m in messages]  # base64, as the API takes them
        chunks = self.client.chat(self.model, messages, options=options or None, keep_alive=self.keep_alive, format=self.format,
                                  think=self.think)
        for chunk in chunks:
            if chunk.get("message", {}).get("thinking"):
                yield ThinkingText(chunk["message"]["thinking"])
            yield chunk.get("message", {}).get("content", "")
            if chunk.get("done"):
                self.metrics = chunk

    def describe(self) -> dict:
        """The server's /api/show answer."""
        return self.client.show(self.model)

    def close(self) -> None:
        """Close the connection to the server."""
        self.client.close()


class LocalChat:
    """Chat turns answered in this process, through a Runtime over the model (no server running).

    The model's Modelfile defaults apply as the server applies them: its PARAMETERs under the session's
    options (stop strings included), its SYSTEM and MESSAGES ahead of the chat, its TEMPLATE when it is Jinja.
    """

    DEFAULT_NUM_PREDICT = 512  # unless the session or the Modelfile says otherwise: an answer ends here

    def __init__(
        self, path: str, defaults: ModelDefaults, fmt: Any, precision: str = "auto", num_ctx: int | None = None, name: str | None = None,
        projector: str | None = None,
    ):  # fmt: skip
        from corral.discover import context_default, system_info
        from corral.runner.blocking import BlockingRuntime

        self.path = path
        self.defaults = defaults
        self.format = fmt
        self.think: bool | str | None = None
        self.metrics: dict = {}
        # The context as the server sizes it: asked for > Modelfile > CORRAL_CONTEXT_LENGTH > by memory.
        self._default_num_ctx = num_ctx or defaults.options.get("num_ctx") or context_default(system_info())
        template = defaults.chat_template(name or path)
        with err_console.status("loading"):
            self._runtime = BlockingRuntime(path, num_ctx=self._default_num_ctx, precision=precision, template=template, projector=projector)
        self._load_ns = int(self._runtime.model.info.load_seconds * 1e9)

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        """The reply's text pieces; `metrics` holds the final chunk's figures afterwards."""
        merged = self.defaults.merge_options(options)
        merged.setdefault("num_predict", self.DEFAULT_NUM_PREDICT)
        runtime = self._runtime_for(merged)
        thinking = self._thinking_parser(runtime)
        extra = {} if self.think is None else {"think": self.think}
        for chunk in runtime.chat(self.defaults.chat_messages(messages), merged, format=self.format, **extra):
            if thinking is not None:
                parsed = thinking.finish() if chunk.done else thinking.feed(chunk.text)
                if parsed.thinking:
                    yield ThinkingText(parsed.thinking)
                if parsed.content:
                    yield parsed.content
            elif chunk.text:
                yield chunk.text
            if chunk.done:
                self.metrics = {
                    "done_reason": chunk.done_reason,
                    "total_duration": chunk.total_duration,
                    "load_duration": self._load_ns,
                    "prompt_eval_count": chunk.prompt_eval_count,
                    "prompt_eval_duration": chunk.prompt_eval_duration,
                    "eval_count": chunk.eval_count,
                    "eval_duration": chunk.eval_duration,
                }
                self._load_ns = 0

    def _thinking_parser(self, runtime: Any) -> Any:
        """A splitter of the thinking from the answer when thinking is on (as the server's, see plan_thinking)."""
        from corral.errors import CorralError
        from corral.thinking import OPEN, ThinkingParser, can_think

        if not self.think:
            return None
        template = runtime.model.template
        if not can_think(template.source):
            raise CorralError(f"{self.path} does not support thinking")
        opener = template.render([{"role": "user", "content": "?"}], think=self.think)
        return ThinkingParser(opener.rstrip().endswith(OPEN))

    def _runtime_for(self, options: dict) -> Any:
        # A different context or batch size needs a runtime of that size (the server reloads for it); the
        # weights stay loaded.
        from corral.runner.blocking import BlockingRuntime

        num_ctx = options.get("num_ctx") or self._default_num_ctx
        num_batch = options.get("num_batch") or self._runtime.num_batch
        if (num_ctx, num_batch) != (self._runtime.num_ctx, self._runtime.num_batch):
            model = self._runtime.model
            self._runtime.close()
            self._runtime = BlockingRuntime(model, num_ctx=num_ctx, num_batch=num_batch)
        return self._runtime

    def close(self) -> None:
        """End the runtime."""
        self._runtime.close()

    def describe(self) -> dict:
        """What /api/show would say, from the loaded GGUF file and the model's defaults."""
        from corral.server.state import format_parameter_size

        loaded = self._runtime.model
        gguf, info = loaded.gguf, loaded.info
        meta = {key: value for key, value in gguf.metadata.items() if not (isinstance(value, list) and len(value) > 64)}
        details = {
            "family": info.architecture,
            "parameter_size": format_parameter_size(info.parameter_count),
            "quantization_level": info.quantization,
        }
        return {
            "details": details,
            "model_info": meta,
            "template": self.defaults.template or gguf.get("tokenizer.chat_template", ""),
            "system": self.defaults.system,
            "license": "\n".join(self.defaults.license) or gguf.get("general.license", ""),
            "modelfile": self.defaults.to_modelfile(self.path).render(),
            "parameters": format_parameters(self.defaults.options),
            "capabilities": ["completion"],
        }
