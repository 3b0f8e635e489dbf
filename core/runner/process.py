"""A model served by a child process (`python -m corral.runner`) behind the Runtime's interface.

    async with RunnerProcess.open(path, num_parallel=4, num_ctx=4096, num_batch=512) as runner:
        async with runner.generate("Why is the sky blue?", {"temperature": 0}) as stream:
            text, final = await stream.collect()

A native crash or an out-of-memory kill then ends the runner, not the server. The protocol is JSON
lines over loopback TCP, one connection per call: the parent sends `{"token", "op", "args"}`; a call
answers `{"result": ...}` or `{"error": {"type", "message"}}`; a stream answers `{"started": true}`
(or an error), then `{"chunk": {...}}` lines and, if the generation fails, an error line. Closing the
connection ends the request's sequence. The port and the token come in the readiness handshake, one
JSON line on the child's stdout; the token keeps other local users off the port.

The child exits when its stdin closes, so it cannot outlive its parent, even one killed with -9.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, AsyncIterator, Sequence

import trio

from corral.errors import InsufficientMemoryError
from corral.model_info import ModelInfo
from corral.runner.interface import Embeddings, RunnerStatus, Stream
from corral.runner.stream import Chunk
from corral.runner.wire import JsonLines, RunnerError, chunk_from_json, error_from_json, images_to_json  # noqa: F401 (RunnerError is re-exported)

log = logging.getLogger("corral.runner")

DEFAULT_LOAD_TIMEOUT = 300.0  # seconds; CORRAL_LOAD_TIMEOUT overrides, as OLLAMA_LOAD_TIMEOUT does Ollama's
HEALTH_INTERVAL = 5.0
HEALTH_TIMEOUT = 10.0
HEALTH_FAILURES = 3  # consecutive failed checks before a runner that still runs is killed as hung
STOP_TIMEOUT = 5.0  # SIGTERM, then this long before SIGKILL
LOG_TAIL = 20

# The child gets these variables and no others: its tools (PATH, the venv, locale), corral's own
# settings, and what torch, CUDA and the math libraries read. Secrets in the server's environment stay there.
ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "TZ", "LANG", "LANGUAGE", "PYTHONPATH", "VIRTUAL_ENV",
    "CC",  # the compiler the native kernels are built with
    "LD_LIBRARY_PATH",
})
ENV_PREFIXES = (
    "LC_", "CORRAL_", "CUDA_", "NVIDIA_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "OMP_", "MKL_",
    "OPENBLAS_", "XDG_",
)


class RunnerLoadError(RunnerError):
    """The runner process could not load the model; the message carries its reason (its last log lines go to the log)."""


class RunnerDiedError(RunnerError):
    """The runner process exited (crashed, was killed, ran out of memory) while serving a request."""


def runner_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the allowed part of ours, then `extra`."""
    env = {key: value for key, value in os.environ.items() if key in ENV_NAMES or key.startswith(ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    return env | (extra or {})


def describe_exit(returncode: int | None) -> str:
    """How a process ended, in words."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the system may have run out of memory)" if returncode == -signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {returncode}"


# --- the parent side ----------------------------------------------------------------------------
def _write_template(template: str) -> str:
    fd, name = tempfile.mkstemp(prefix="corral-template-", suffix=".jinja")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(template)
    return name


def _remove(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _stream_receiver(runner: RunnerProcess, lines: JsonLines):
    """The next chunk of a generation in the child, None after its last; its error, or RunnerDiedError."""
    done = False

    async def receive() -> Chunk | None:
        nonlocal done
        try:
            message = await lines.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            message = None
        if message is None:
            if done:
                return None
            raise await runner._died("during a generation")
        if "error" in message:
            raise error_from_json(message["error"])
        chunk = chunk_from_json(message["chunk"])
        done = done or chunk.done
        return chunk

    return receive


class RunnerProcess:
    """One model served by a child process: a `Runner`, like the in-process `Runtime`."""

    def __init__(self, process: trio.Process, path: str, health_interval: float):
        self.path = path
        self.pid = process.pid
        self.returncode: int | None = None
        self.exited = trio.Event()  # the child is gone: the scheduler should drop this runner
        self.health_interval = health_interval
        self.info: ModelInfo | None = None  # known once the child is ready, as are these two
        self.vocab_size = 0
        self._process = process
        self._port = 0
        self._token = ""
        self._status: RunnerStatus | None = None
        self._hung = False
        self._stopping = False
        self._log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self._log_done = trio.Event()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike,
        *,
        num_parallel: int = 4,
        num_ctx: int = 4096,
        num_batch: int = 512,
        num_thread: int = 0,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        precision: str = "auto",
        kv_cache_type: str = "f16",
        kv_cache_fallback: bool = False,
        name: str | None = None,
        device: str | None = None,
        template: str | None = None,
        projector: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        load_timeout: float | None = None,
        health_interval: float = HEALTH_INTERVAL,
        lower_context: bool = True,
    ) -> AsyncIterator[RunnerProcess]:
        """Start a runner for the GGUF at `path`, wait until it has loaded, and stop it when the block exits.

        Raises RunnerLoadError, with the child's reason and last log lines, when it cannot load.
        `kv_cache_fallback` and `name` are Runtime.open's.
        `env` adds variables to the allowed part of ours (see `runner_env`).
        """
        path = os.fspath(path)
        if load_timeout is None:
            load_timeout = float(os.environ.get("CORRAL_LOAD_TIMEOUT") or DEFAULT_LOAD_TIMEOUT)
        command = [
            sys.executable, "-X", "faulthandler", "-m", "corral.runner", "--model", path,
            "--num-parallel", str(num_parallel), "--num-ctx", str(num_ctx), "--num-batch", str(num_batch),
            "--precision", precision, "--num-thread", str(num_thread), "--tensor-parallel", str(tensor_parallel),
            "--pipeline-parallel", str(pipeline_parallel), "--kv-cache-type", kv_cache_type,
        ] + (["--device", device] if device else []) + (["--kv-cache-fallback"] if kv_cache_fallback else []) + (
            ["--name", name] if name else []
        ) + (["--projector", os.fspath(projector)] if projector else []) + (
            [] if lower_context else ["--keep-context"]
        )
        template_file = _write_template(template) if template is not None else None
        if template_file:
            command += ["--template-file", template_file]
        failure: BaseException | None = None
        try:
            process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=runner_env(env),
                start_new_session=True,  # a Ctrl-C in the terminal reaches the server, which stops the child
            )
        except BaseException:
            _remove(template_file)
            raise
        runner = cls(process, path, health_interval)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runner._forward_log)
                nursery.start_soon(runner._watch_exit)
                try:
                    with trio.fail_after(load_timeout):
                        await runner._handshake()
                except trio.TooSlowError:
                    failure = RunnerLoadError(
                        f"the runner for {path} did not load the model within {load_timeout:g} s "
                        f"(CORRAL_LOAD_TIMEOUT){runner._tail()}"
                    )
                except RunnerLoadError as exc:
                    failure = exc
                else:
                    _remove(template_file)  # read before loading; a server killed later leaves nothing behind
                    nursery.start_soon(runner._watch_health)
                    try:
                        yield runner
                    finally:
                        await runner._stop()
                await runner._stop()
                nursery.cancel_scope.cancel()
        finally:
            await runner._stop()  # also when the start itself was cancelled
            _remove(template_file)
        if failure is not None:
            raise failure

    # --- the Runtime interface --------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the child runs and answers."""
        return not self.exited.is_set() and not self._hung and not self._stopping

    @property
    def num_ctx(self) -> int:
        return self._status.num_ctx

    def status(self) -> RunnerStatus:
        """The child's gauges as of the last health check (or `refresh`)."""
        return self._status

    async def close(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL); requests in flight end with RunnerDiedError."""
        await self._stop()

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], truncate: bool = True, dimensions: int | None = None, normalized: bool = True
    ) -> Embeddings:
        """One embedding per input, computed by the child."""
        inputs = [item if isinstance(item, str) else list(item) for item in inputs]
        result = await self._call("embed", inputs=inputs, truncate=truncate, dimensions=dimensions, normalized=normalized)
        return Embeddings.from_json(result)

    def generate(
        self,
        prompt: str,
        options: dict | None = None,
        *,
        raw: bool = False,
        system: str | None = None,
        context: list[int] | None = None,
        shift: bool = True,
        logprobs: bool = False,
        top_logprobs: int = 0,
        format: str | dict | None = None,
        images: Sequence[bytes] = (),
        think: bool | str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Stream]:
        """Stream the completion of `prompt`, as `Runtime.generate` does."""
        args = dict(prompt=prompt, options=options, raw=raw, system=system, context=context, shift=shift,
                    logprobs=logprobs, top_logprobs=top_logprobs, format=format, images=images_to_json(images), think=think)
        return self._stream("generate", args)

    def chat(
        self,
        messages: list[dict],
        options: dict | None = None,
        *,
        tools: list[dict] | None = None,
        shift: bool = True,
        logprobs: bool = False,
        top_logprobs: int = 0,
        format: str | dict | None = None,
        think: bool | str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Stream]:
        """Stream the assistant's reply to `messages`, as `Runtime.chat` does."""
        messages = [{**m, "images": images_to_json(m["images"])} if m.get("images") else m for m in messages]
        args = dict(messages=messages, options=options, tools=tools, shift=shift, logprobs=logprobs,
                    top_logprobs=top_logprobs, format=format, think=think)
        return self._stream("chat", args)

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`."""
        return await self._call("tokenize", text=text, add_special=add_special)

    async def detokenize(self, ids: list[int]) -> str:
        """Text of token ids."""
        return await self._call("detokenize", ids=list(ids))

    async def refresh(self) -> RunnerStatus:
        """Ask the child for its status now (the health check does this every `health_interval`)."""
        self._status = RunnerStatus.from_json(await self._call("status"))
        return self._status

    # --- internals --------------------------------------------------------------------------
    async def _connect(self, what: str) -> JsonLines:
        if self.exited.is_set():
            raise await self._died(what)
        try:
            return JsonLines(await trio.open_tcp_stream("127.0.0.1", self._port))
        except OSError:
            raise await self._died(what) from None

    async def _call(self, op: str, **args: Any) -> Any:
        lines = await self._connect(f"before answering {op}")
        async with lines.stream:
            try:
                await lines.send({"token": self._token, "op": op, "args": args})
                reply = await lines.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                reply = None
        if reply is None:
            raise await self._died(f"while answering {op}")
        if "error" in reply:
            raise error_from_json(reply["error"])
        return reply["result"]

    @contextlib.asynccontextmanager
    async def _stream(self, op: str, args: dict) -> AsyncIterator[Stream]:
        lines = await self._connect(f"before a {op} request")
        async with lines.stream:  # leaving closes the connection, which ends the child's sequence
            try:
                await lines.send({"token": self._token, "op": op, "args": args})
                first = await lines.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                first = None
            if first is None:
                raise await self._died(f"before starting a {op} request")
            if "error" in first:
                raise error_from_json(first["error"])
            yield Stream(_stream_receiver(self, lines))

    async def _died(self, what: str) -> RunnerDiedError:
        """The error for a request the child stopped answering: how it ended, and its last words."""
        with trio.move_on_after(2):
            await self.exited.wait()
        with trio.move_on_after(0.5):
            await self._log_done.wait()
        name = self.info.name if self.info else self.path
        if self._hung:
            how = "stopped answering its health checks and was killed"
        elif self.exited.is_set():
            how = describe_exit(self.returncode)
        elif self._stopping:
            how = "is being stopped"
        else:
            how = "closed the connection"
        return RunnerDiedError(f"the runner for {name} (pid {self.pid}) {how} {what}{self._tail(5)}")

    async def _handshake(self) -> None:
        ready = None
        try:
            ready = await JsonLines(self._process.stdout).receive()
        except (ValueError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if isinstance(ready, dict) and "port" in ready:
            self._port, self._token = int(ready["port"]), str(ready["token"])
            self.info, self.vocab_size = ModelInfo(**ready["info"]), int(ready["vocab_size"])
            self._status = RunnerStatus.from_json(ready["status"])
            log.info("runner pid %d serves %s on port %d", self.pid, self.path, self._port)
            return
        with trio.move_on_after(STOP_TIMEOUT):
            await self.exited.wait()
        with trio.move_on_after(1):
            await self._log_done.wait()
        if isinstance(ready, dict) and ready.get("error", {}).get("type") == InsufficientMemoryError.__name__:
            raise InsufficientMemoryError(ready["error"].get("message", ""))  # the scheduler may unload others and retry
        if isinstance(ready, dict) and "error" in ready:
            reason = ready["error"].get("message") or ready["error"].get("type")
        else:
            reason = f"it {describe_exit(self._process.returncode)} before it was ready"
        raise RunnerLoadError(f"the runner failed to load the model: {reason}{self._tail()}")

    def _tail(self, count: int = LOG_TAIL) -> str:
        """The child's last log lines into this process's log, and a pointer to them for an error's message.

        Not the lines themselves: a message reaches HTTP clients, and the lines are often a traceback."""
        lines = list(self._log_tail)[-count:]
        if not lines:
            return ""
        log.warning("runner pid %s's last log lines:\n%s", self.pid, "\n".join("  " + line for line in lines))
        return " (its last log lines are in the server's log)"

    async def _forward_log(self) -> None:
        """The child's stderr, line by line, into our `corral.runner` log at the level each line was logged."""
        lines, level = JsonLines(self._process.stderr), logging.WARNING
        try:
            while (line := await lines.receive_line()) is not None:
                text = line.decode(errors="replace").rstrip()
                named = logging.getLevelName(text.split(" ", 1)[0])
                # a line without a level (a traceback, a native crash) keeps its logger line's level, at least WARNING
                level = named if isinstance(named, int) else max(level, logging.WARNING)
                self._log_tail.append(text)
                log.log(level, "[runner %d] %s", self.pid, text)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RunnerError):
            pass
        finally:
            self._log_done.set()

    async def _watch_exit(self) -> None:
        self.returncode = await self._process.wait()
        self.exited.set()
        if not self._stopping and self.info is not None:  # before it was ready, the load error says it
            log.error("the runner for %s (pid %d) %s", self.path, self.pid, describe_exit(self.returncode))

    async def _watch_health(self) -> None:
        failures = 0
        while not self.exited.is_set():
            await trio.sleep(self.health_interval)
            try:
                with trio.fail_after(HEALTH_TIMEOUT):
                    await self.refresh()
            except (RunnerError, OSError, trio.TooSlowError) as exc:
                if self.exited.is_set() or self._stopping:
                    return
                failures += 1
                log.warning("the runner for %s (pid %d) failed a health check: %s", self.path, self.pid, exc)
                if failures >= HEALTH_FAILURES:
                    log.error("the runner for %s (pid %d) stopped answering; killing it", self.path, self.pid)
                    self._hung = True
                    self._signal(signal.SIGKILL)
                    return
            else:
                failures = 0

    def _signal(self, signum: int) -> None:
        # The whole process group: anything the child started (compile workers) goes with it.
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)

    async def _stop(self) -> None:
        """Close the child's stdin, SIGTERM it, SIGKILL it after STOP_TIMEOUT, and reap it; idempotent."""
        self._stopping = True
        with trio.CancelScope(shield=True):
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError, OSError):
                await self._process.stdin.aclose()
            if self._process.returncode is None:
                self._signal(signal.SIGTERM)
                with trio.move_on_after(STOP_TIMEOUT):
                    await self._process.wait()
                if self._process.returncode is None:
                    log.warning("the runner pid %d did not exit %g s after SIGTERM; killing it", self.pid, STOP_TIMEOUT)
                    self._signal(signal.SIGKILL)
                    await self._process.wait()
            self.returncode = self._process.returncode
            with trio.move_on_after(1):
                await self._log_done.wait()  # the child's last lines reach the log
            self.exited.set()
