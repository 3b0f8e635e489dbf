"""Where a chat's answers come from: a running server (over /api/chat), or a model loaded in this process."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

from corral.cli.display import PullProgress, err_console
from corral.client import Client, ServerError
from corral.errors import CorralError


def running_server() -> Client | None:
    """A client for the server at CORRAL_HOST, or None when none answers there."""
    client = Client()
    if client.is_running():
        return client
    client.close()
    return None


def chat_backend(model: str, keep_alive: str | None, fmt: Any, precision: str, preload: bool) -> ServerChat | LocalChat:
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
    if fmt is not None:
        raise CorralError("--format needs a running server; start one with `corral serve`")
    if not is_file:
        pull_in_process_if_missing(model)
    from corral.engine import load_model

    return LocalChat(load_model(model, precision=precision))


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
        chunks = self.client.chat(self.model, messages, options=options or None, keep_alive=self.keep_alive, format=self.format)
        for chunk in chunks:
            yield chunk.get("message", {}).get("content", "")
            if chunk.get("done"):
                self.metrics = chunk

    def describe(self) -> dict:
        """The server's /api/show answer."""
        return self.client.show(self.model)


class LocalChat:
    """Chat turns answered in this process by a loaded model (no server running)."""

    DEFAULT_TEMPERATURE = 0.8
    DEFAULT_NUM_PREDICT = 512

    def __init__(self, loaded: Any):
        self.loaded = loaded
        self.metrics: dict = {}
        self._load_ns = int(loaded.info.load_seconds * 1e9)

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        from corral.engine import DEFAULT_NUM_CTX

        start = time.perf_counter_ns()
        ids = self.loaded.chat_ids(messages)
        num_ctx = min(options.get("num_ctx") or DEFAULT_NUM_CTX, self.loaded.info.context_length)
        num_predict = options.get("num_predict", self.DEFAULT_NUM_PREDICT)
        if num_predict < 0:  # -1 unlimited, -2 until the context is full: both mean "the rest of it" here
            num_predict = num_ctx - len(ids)
        seed = options.get("seed")
        yield from self.loaded.generate_ids(
            ids,
            max_tokens=num_predict,
            temperature=options.get("temperature", self.DEFAULT_TEMPERATURE),
            seed=None if seed is None or seed < 0 else seed,
            num_ctx=num_ctx,
            options={k: v for k, v in options.items() if k not in ("temperature", "seed", "num_predict", "num_ctx")},
        )
        elapsed = time.perf_counter_ns() - start
        self.metrics = {"total_duration": elapsed, "load_duration": self._load_ns, "prompt_eval_count": len(ids)}
        self._load_ns = 0

    def describe(self) -> dict:
        """What /api/show would say, from the loaded GGUF file."""
        from corral.server.state import format_parameter_size

        gguf, info = self.loaded.gguf, self.loaded.info
        meta = {key: value for key, value in gguf.metadata.items() if not (isinstance(value, list) and len(value) > 64)}
        details = {
            "family": info.architecture,
            "parameter_size": format_parameter_size(info.parameter_count),
            "quantization_level": info.quantization,
        }
        return {
            "details": details,
            "model_info": meta,
            "template": gguf.get("tokenizer.chat_template", ""),
            "license": gguf.get("general.license", ""),
            "modelfile": f"FROM {self.loaded.path}\n",
            "parameters": "",
            "capabilities": ["completion"],
        }
