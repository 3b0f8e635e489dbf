"""The scheduler: which models are loaded, for how long, and who may use them.

A request asks for a model by name with its load-time options; the scheduler hands back the
runner that serves it, loading it first when needed (one load at a time), reloading when a
load-time option changed, and unloading it `keep_alive` after its last request ends. Each loaded
model's runner lives in a task of the scheduler's nursery.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import re
import time
from typing import Any, AsyncIterator

import attrs
import trio

from corral.discover import context_default, effective_num_ctx, system_info
from corral.errors import CorralError, InsufficientMemoryError, ModelNotFoundError
from corral.modelfile import model_defaults
from corral.options import DEFAULT_KV_CACHE_TYPE, LOAD_TIME_OPTIONS, STANDARD_OPTIONS, InvalidOptionError, checked_kv_cache_type, parse_options
from corral.parallel.shards import check_split
from corral.registry import Plugins
from corral.runner.interface import Runner
from corral.runner.process import RunnerProcess
from corral.store import Store, default_store, parse_name
from corral.template import TemplateError, compile_template

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0  # seconds
DEFAULT_NUM_PARALLEL = 4
DEFAULT_MAX_QUEUE = 512
DEFAULT_MAX_LOADED_MODELS = 3
RUNNERS = ("process", "inprocess")
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ServerBusyError(CorralError):
    """More requests are waiting than CORRAL_MAX_QUEUE allows."""


class InvalidKeepAliveError(CorralError):
    """keep_alive is neither a number of seconds nor a duration such as "5m"."""


def parse_keep_alive(value: Any) -> float | None:
    """Seconds to keep a model loaded: a number, or a Go duration ("5m", "1h30m"); negative means forever.

    Returns None for "not given", math.inf for forever.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidKeepAliveError(f"keep_alive must be a duration like \"5m\" or a number of seconds, not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(number + unit for number, unit in parts) != text.replace("+", ""):
                raise InvalidKeepAliveError(
                    f"keep_alive {value!r} is not a duration; use a number of seconds or a duration like \"5m\""
                ) from None
            seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    else:
        raise InvalidKeepAliveError(f"keep_alive must be a duration like \"5m\" or a number of seconds, not {value!r}")
    if math.isnan(seconds):  # float("nan") parses
        raise InvalidKeepAliveError(f"keep_alive must be a duration like \"5m\" or a number of seconds, not {value!r}")
    return math.inf if seconds < 0 else seconds


def setting(name: str, default: int) -> int:
    """An integer setting: CORRAL_<name>, else Ollama's OLLAMA_<name>, else `default`; a clear error when not a number."""
    for key in (f"CORRAL_{name}", f"OLLAMA_{name}"):
        value = os.environ.get(key, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise CorralError(f"{key}={value!r} is not an integer") from None
    return default


def kv_cache_type_from_env() -> str:
    """CORRAL_KV_CACHE_TYPE, else Ollama's OLLAMA_KV_CACHE_TYPE, else f16 (any case, as Ollama lowercases it).

    As Ollama does with OLLAMA_KV_CACHE_TYPE, a name it does not know is logged as unsupported and the
    cache stays f16: the setting is a preference, so a typo must not stop the server from serving."""
    for key in ("CORRAL_KV_CACHE_TYPE", "OLLAMA_KV_CACHE_TYPE"):
        value = os.environ.get(key, "").strip().lower()
        if value:
            try:
                return checked_kv_cache_type(value, key)
            except InvalidOptionError as error:
                log.warning("%s; using %s", error, DEFAULT_KV_CACHE_TYPE)
                return DEFAULT_KV_CACHE_TYPE
    return DEFAULT_KV_CACHE_TYPE


def keep_alive_from_env() -> float:
    """CORRAL_KEEP_ALIVE (or OLLAMA_KEEP_ALIVE), else five minutes."""
    for key in ("CORRAL_KEEP_ALIVE", "OLLAMA_KEEP_ALIVE"):
        parsed = parse_keep_alive(os.environ.get(key))
        if parsed is not None:
            return parsed
    return DEFAULT_KEEP_ALIVE


def _positive_env(key: str, default: int) -> int:
    """A positive integer from the environment variable `key`, else `default`."""
    text = os.environ.get(key, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise CorralError(f"{key} must be a positive integer, not {text!r}")
    return int(text)


@attrs.define(eq=False)
class Loaded:
    """A model held by the scheduler."""

    name: str
    path: Any
    load_options: dict[str, Any]
    runtime: Runner | None = None  # a Runtime in-process, else a RunnerProcess
    users: int = 0
    keep_alive: float = DEFAULT_KEEP_ALIVE
    expires_at: float | None = None  # wall-clock seconds; None while in use; inf for forever
    load_seconds: float = 0.0
    size: int = 0  # predicted bytes: weights + KV cache + compute buffers
    unload: trio.Event = attrs.field(factory=trio.Event)
    stopped: trio.Event = attrs.field(factory=trio.Event)
    expiry: trio.CancelScope | None = None
    idle: trio.Event | None = None  # set when the last user leaves, for a waiting unload

    @property
    def expires_at_datetime(self) -> datetime.datetime:
        if self.expires_at is None or math.isinf(self.expires_at):
            # In use or kept forever: report far in the future, as Ollama does.
            return datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc)
        return datetime.datetime.fromtimestamp(self.expires_at, tz=datetime.timezone.utc)


class Scheduler:
    """Loads models on demand into runtimes owned by its nursery."""

    def __init__(
        self,
        store: Store | None = None,
        plugins: Plugins | None = None,
        num_parallel: int | None = None,
        default_num_ctx: int | None = None,
        runner: str | None = None,
        tensor_parallel: int | None = None,
        pipeline_parallel: int | None = None,
        kv_cache_type: str | None = None,
    ):
        self.store = store or default_store()
        self.plugins = plugins or Plugins()
        self.num_parallel = num_parallel or max(1, setting("NUM_PARALLEL", DEFAULT_NUM_PARALLEL))
        # None: CORRAL_CONTEXT_LENGTH / OLLAMA_CONTEXT_LENGTH, else by GPU memory (discovered once per process).
        self.default_num_ctx = default_num_ctx or context_default(system_info())
        self.default_keep_alive = keep_alive_from_env()
        self.max_queue = setting("MAX_QUEUE", DEFAULT_MAX_QUEUE)
        self.max_loaded = max(1, setting("MAX_LOADED_MODELS", DEFAULT_MAX_LOADED_MODELS))
        self.runner = runner or os.environ.get("CORRAL_RUNNER", "process")
        # Ranks (stages) each model is split over unless a request's `tensor_parallel` (`pipeline_parallel`) option says otherwise.
        self.tensor_parallel = tensor_parallel or _positive_env("CORRAL_TENSOR_PARALLEL", 1)
        self.pipeline_parallel = pipeline_parallel or _positive_env("CORRAL_PIPELINE_PARALLEL", 1)
        self.kv_cache_type = kv_cache_type or kv_cache_type_from_env()  # unless a request's `kv_cache_type` option says otherwise
        if self.runner not in RUNNERS:
            raise CorralError(f"CORRAL_RUNNER must be one of {', '.join(RUNNERS)}, not {self.runner!r}")
        self.loaded: dict[str, Loaded] = {}
        self._load_lock = trio.Lock()  # one load at a time
        self.runner_restarts: dict[str, int] = {}  # by model: runners that died, replaced on the next request (/metrics)
        self._starting = 0  # requests waiting for their model to be found or loaded
        self._idle = trio.Event()  # set whenever a model's last request ends
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the runtimes until cancelled; everything loaded is unloaded on the way out."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    def resolve(self, name: str) -> tuple[str, Any]:
        """The canonical model name and its GGUF path (ModelNotFoundError when absent)."""
        canonical = str(parse_name(name))
        try:
            return canonical, self.store.model_path(canonical)
        except ModelNotFoundError:
            raise ModelNotFoundError(f"model '{name}' not found") from None

    @contextlib.asynccontextmanager
    async def use(self, name: str, options: dict | None = None, keep_alive: Any = None) -> AsyncIterator[Loaded]:
        """The loaded model for a request, kept loaded while the block runs and `keep_alive` after."""
        keep = parse_keep_alive(keep_alive)
        options = checked_standard_options(options)
        if self.queued() >= self.max_queue:
            raise ServerBusyError("server busy, please try again.  maximum pending requests exceeded")
        self._starting += 1
        try:
            entry = await self._acquire(name, options or {})
        finally:
            self._starting -= 1
        try:
            yield entry
        finally:
            self._release(entry, self.default_keep_alive if keep is None else keep)

    def queued(self) -> int:
        """Requests that cannot start at once: waiting for a load, or for one of a model's sequence slots."""
        beyond_slots = sum(max(0, entry.users - self.num_parallel) for entry in self.loaded.values())
        return self._starting + beyond_slots

    async def unload(self, name: str) -> bool:
        """Unload a model now (requests using it finish first); False if it was not loaded."""
        canonical = str(parse_name(name))
        entry = self.loaded.get(canonical)
        if entry is None:
            return False
        await self._stop(entry)
        return True

    async def drain(self) -> None:
        """Return once no request is using or waiting for a model (the server is stopping)."""
        while self._starting or any(entry.users for entry in self.loaded.values()):
            await trio.sleep(0.05)

    async def stop_all(self) -> None:
        """Unload every model now, requests in flight or not: their streams end with the runner's error."""
        for entry in list(self.loaded.values()):
            entry.unload.set()
        for entry in list(self.loaded.values()):
            await entry.stopped.wait()

    async def _acquire(self, name: str, options: dict) -> Loaded:
        canonical, path = self.resolve(name)
        wanted = {key: options[key] for key in LOAD_TIME_OPTIONS if options.get(key) is not None}
        async with self._load_lock:
            entry = self.loaded.get(canonical)
            if entry is not None and not entry.runtime.alive:
                entry.unload.set()  # its runner died: load a fresh one below
                await entry.stopped.wait()
                entry = None
            if entry is not None and not _compatible(entry.load_options, wanted):
                await self._stop(entry)  # a load-time option changed: reload
                entry = None
            if entry is None:
                await self._make_room()
                entry = await self._load_fitting(canonical, path, wanted)
            entry.users += 1
            if entry.expiry is not None:
                entry.expiry.cancel()
            entry.expires_at = None
        return entry

    async def _make_room(self) -> None:
        """Unload idle models (expiring soonest first) until one more may load (CORRAL_MAX_LOADED_MODELS)."""
        while len(self.loaded) >= self.max_loaded:
            victim = self._next_victim()
            if victim is not None:
                log.info("unloading %s to make room", victim.name)
                await self._stop(victim)
            else:
                self._idle = trio.Event()
                await self._idle.wait()  # every loaded model is busy: wait for one to go idle

    async def _load_fitting(self, name: str, path: Any, wanted: dict) -> Loaded:
        """Load the model; while it does not fit in memory and idle models are loaded, unload those first.

        The runner checks the fit (its backend knows the device): with idle models still loaded it is
        asked to refuse rather than lower the context, so their memory is taken before the new model's context.
        """
        while True:
            victim = self._next_victim()
            try:
                return await self._load(name, path, wanted, lower_context=victim is None)
            except InsufficientMemoryError:
                if victim is None:
                    raise
            log.info("unloading %s: %s does not fit in memory beside it", victim.name, name)
            await self._stop(victim)

    def _next_victim(self) -> Loaded | None:
        """The idle model that expires soonest, if any."""
        idle = [entry for entry in self.loaded.values() if entry.users == 0]
        return min(idle, key=lambda entry: entry.expires_at if entry.expires_at is not None else math.inf, default=None)

    async def _load(self, name: str, path: Any, load_options: dict, lower_context: bool = True) -> Loaded:
        entry = Loaded(name, path, load_options)
        start = time.perf_counter()
        await self._nursery.start(self._hold, entry, lower_context)
        entry.load_seconds = time.perf_counter() - start
        entry.size = entry.runtime.status().memory_estimate
        self.loaded[name] = entry
        log.info("loaded %s in %.2fs", name, entry.load_seconds)
        return entry

    async def _hold(self, entry: Loaded, lower_context: bool, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            num_ctx = entry.load_options.get("num_ctx") or self.default_num_ctx
            num_batch = entry.load_options.get("num_batch") or 512
            template = await trio.to_thread.run_sync(self._template, entry.name)
            await trio.to_thread.run_sync(check_split, entry.path, *self._splits(entry.load_options).values())  # a clear 400 before any runner starts
            projector = await trio.to_thread.run_sync(self.store.projector_path, entry.name)
            async with self._open_runtime(
                entry.name, entry.path, entry.load_options, num_ctx, num_batch, template, lower_context, projector
            ) as runtime:
                # The runner clamps to the trained context, known only now; this says so when a request asked for more.
                effective_num_ctx(
                    entry.load_options.get("num_ctx"), runtime.info.context_length, None, self.default_num_ctx,
                    model=entry.name,
                )
                entry.runtime = runtime
                task_status.started()
                async with trio.open_nursery() as watch:
                    watch.start_soon(_set_after, runtime.exited, entry.unload)  # a runner that dies unloads itself
                    await entry.unload.wait()
                    watch.cancel_scope.cancel()
                if runtime.exited.is_set():  # it died (crash, kill, out of memory): the next request loads a fresh one
                    self.runner_restarts[entry.name] = self.runner_restarts.get(entry.name, 0) + 1
        finally:
            entry.stopped.set()
            if self.loaded.get(entry.name) is entry:
                del self.loaded[entry.name]

    def _open_runtime(
        self, name: str, path: Any, load_options: dict, num_ctx: int, num_batch: int, template: str | None, lower_context: bool,
        projector: Any = None,
    ) -> contextlib.AbstractAsyncContextManager[Runner]:
        """The model's runner: a child process by default (a native crash cannot take the server down), or in-process.

        `projector`: the model's vision projector file, loaded beside it. A `kv_cache_type` the request or
        Modelfile asked for is refused (a 400) where the model cannot take it; the server's setting
        falls back to f16 for such a model, with a warning, as Ollama's OLLAMA_KV_CACHE_TYPE does."""
        asked = load_options.get("kv_cache_type")
        sizes = dict(
            num_parallel=self.num_parallel, num_ctx=num_ctx, num_batch=num_batch, lower_context=lower_context,
            kv_cache_type=asked or self.kv_cache_type, kv_cache_fallback=asked is None, name=name,
        )
        num_thread = load_options.get("num_thread") or 0
        splits = self._splits(load_options)
        projector = str(projector) if projector else None
        if self.runner == "inprocess":
            from corral.runner.runtime import Runtime  # torch: only a server that computes in-process imports it

            return Runtime.open(str(path), **sizes, plugins=self.plugins, template=template, num_thread=num_thread, projector=projector, **splits)
        return RunnerProcess.open(path, **sizes, template=template, num_thread=num_thread, projector=projector, **splits)

    def _splits(self, load_options: dict) -> dict[str, int]:
        """How many processes the model is split over: the request's options, else the server's defaults."""
        return dict(
            tensor_parallel=load_options.get("tensor_parallel") or self.tensor_parallel,
            pipeline_parallel=load_options.get("pipeline_parallel") or self.pipeline_parallel,
        )

    def _template(self, name: str) -> str | None:
        """A Modelfile TEMPLATE to use instead of the file's (Jinja or Go), checked before any runner starts."""
        template = model_defaults(self.store, name).chat_template(name)
        if template:
            try:
                compile_template(template)  # before a runner starts: a clear 400, not a failed load
            except TemplateError as error:
                raise TemplateError(f"model '{name}' has a TEMPLATE corral cannot use: {error}") from None
        return template

    def _release(self, entry: Loaded, keep_alive: float) -> None:
        entry.users -= 1
        entry.keep_alive = keep_alive
        if entry.users == 0:
            self._idle.set()
            if entry.idle is not None:
                entry.idle.set()
        if entry.users > 0 or entry.unload.is_set():
            return
        if keep_alive == 0:
            entry.unload.set()
            return
        entry.expires_at = math.inf if math.isinf(keep_alive) else time.time() + keep_alive
        if not math.isinf(keep_alive):
            entry.expiry = trio.CancelScope()
            self._nursery.start_soon(self._expire, entry, entry.expiry, keep_alive)

    async def _expire(self, entry: Loaded, scope: trio.CancelScope, delay: float) -> None:
        with scope:
            await trio.sleep(delay)
            if entry.users == 0:
                entry.unload.set()

    async def _stop(self, entry: Loaded) -> None:
        if entry.users:
            entry.idle = trio.Event()
            await entry.idle.wait()  # let running requests finish
        entry.unload.set()
        await entry.stopped.wait()


async def _set_after(event: trio.Event, then: trio.Event) -> None:
    await event.wait()
    then.set()


def _compatible(loaded: dict, wanted: dict) -> bool:
    return all(loaded.get(key) == value for key, value in wanted.items())


def checked_standard_options(options: dict | None) -> dict:
    """`options` with Ollama's own options validated and typed (InvalidOptionError naming the field), so a
    negative num_ctx is a 400 before any runner sees it. Sampler plugins' options pass unchanged: the
    runtime checks them against the chain that declares them."""
    options = dict(options or {})
    standard = {name: value for name, value in options.items() if name in STANDARD_OPTIONS and value is not None}
    parsed = parse_options(standard)
    return options | {name: parsed.get(name) for name in standard}
