"""`python -m corral.runner --model PATH ...`: one model's Runtime, served to the parent that started it.

The wire format and the parent side are in `corral.runner.process`. Once the model is loaded this
prints one JSON line on the original stdout, `{"port", "pid", "token", "info", "vocab_size",
"status"}`, or `{"error": {...}}` when loading failed (then it exits 1). Everything else, stray prints
included, goes to stderr, which the parent forwards to its log. It exits on SIGTERM or SIGINT, and
when its stdin closes: the parent has gone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hmac
import json
import logging
import os
import secrets
import signal
import sys
import threading
from typing import IO, Any

import attrs
import trio

from corral.errors import CorralError
from corral.runner.wire import JsonLines, chunk_to_json, error_to_json, images_from_json
from corral.runner.runtime import Runtime

log = logging.getLogger("corral.runner.child")

EXIT_GRACE = 10.0  # seconds from the parent leaving or a SIGTERM to a forced exit


class RunnerServer:
    """Answers the parent's calls on loopback TCP, one connection per call."""

    def __init__(self, runtime: Runtime, token: str):
        self.runtime = runtime
        self.token = token

    async def handle(self, stream: trio.SocketStream) -> None:
        """One call; a broken connection means the parent went away and ends it quietly."""
        lines = JsonLines(stream)
        try:
            async with stream:
                request = await lines.receive()
                token = str(request.get("token")) if isinstance(request, dict) else ""
                if not hmac.compare_digest(token.encode(), self.token.encode()):
                    return  # not our parent
                op, args = request.get("op"), request.get("args") or {}
                if op in ("generate", "chat"):
                    await self._stream(op, args, lines)
                else:
                    await self._answer(op, args, lines)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # a bad request must not end the runner
            log.exception("runner call failed")

    async def _answer(self, op: Any, args: dict, lines: JsonLines) -> None:
        try:
            if op == "tokenize":
                result = await self.runtime.tokenize(args["text"], add_special=args.get("add_special", True))
            elif op == "detokenize":
                result = await self.runtime.detokenize(args["ids"])
            elif op == "embed":
                embedded = await self.runtime.embed(
                    args["inputs"], truncate=args.get("truncate", True), dimensions=args.get("dimensions"), normalized=args.get("normalized", True)
                )
                result = embedded.to_json()
            elif op == "status":
                result = self.runtime.status().to_json()
            else:
                raise ValueError(f"unknown runner call {op!r}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as exc:  # reported to the caller
            await lines.send({"error": error_to_json(exc)})
        else:
            await lines.send({"result": result})

    async def _stream(self, op: str, args: dict, lines: JsonLines) -> None:
        start = self.runtime.generate if op == "generate" else self.runtime.chat
        args = images_from_json(op, args)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_close, lines.stream, scope)
                try:
                    async with start(**args) as stream:
                        await lines.send({"started": True})
                        async for chunk in stream:
                            await lines.send({"chunk": chunk_to_json(chunk)})
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the parent left: the sequence has ended with the block
                except Exception as exc:  # before "started" it fails the request's start, after it the stream
                    with _quietly():
                        await lines.send({"error": error_to_json(exc)})
                nursery.cancel_scope.cancel()


async def _cancel_on_close(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    # The parent closes its end to cancel a generation; nothing else arrives after the request.
    with _quietly():
        while await stream.receive_some(1 << 12):
            pass
    scope.cancel()


def _quietly() -> contextlib.AbstractContextManager:
    return contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError)


async def serve(args: argparse.Namespace, template: str | None, handshake: IO[str]) -> int:
    """Load the model, tell the parent where it is served, and serve it until cancelled; 1 if it cannot load."""
    ready = False
    try:
        async with Runtime.open(
            args.model, num_parallel=args.num_parallel, num_ctx=args.num_ctx, num_batch=args.num_batch,
            precision=args.precision, device=args.device, template=template, num_thread=args.num_thread,
            tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel, projector=args.projector,
            lower_context=not args.keep_context, kv_cache_type=args.kv_cache_type, kv_cache_fallback=args.kv_cache_fallback,
            name=args.name,
        ) as runtime:
            ready = True
            token = secrets.token_hex(16)
            server = RunnerServer(runtime, token)
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
                port = listeners[0].socket.getsockname()[1]
                _say(handshake, {
                    "port": port, "pid": os.getpid(), "token": token, "info": attrs.asdict(runtime.info),
                    "vocab_size": runtime.vocab_size,
                    "status": runtime.status().to_json(),
                })
                log.info("serving %s on 127.0.0.1:%d", args.model, port)
    except Exception as exc:
        if ready:
            raise
        # A user's mistake (not a GGUF, unknown architecture) needs its message; anything else its traceback.
        log.error("could not load %s: %s", args.model, exc, exc_info=not isinstance(exc, CorralError))
        _say(handshake, {"error": error_to_json(exc)})
        return 1
    return 0


def _say(handshake: IO[str], message: dict) -> None:
    handshake.write(json.dumps(message) + "\n")
    handshake.flush()
    handshake.close()


def _exit_soon() -> None:
    # A model load in progress cannot be cancelled; never outlive the request to stop by more than this.
    timer = threading.Timer(EXIT_GRACE, os._exit, (1,))
    timer.daemon = True
    timer.start()


async def _exit_when_orphaned(scope: trio.CancelScope) -> None:
    """Our stdin is the parent's pipe: at its end the parent has gone, and so do we."""
    async with trio.lowlevel.FdStream(os.dup(0)) as stdin:
        with contextlib.suppress(trio.BrokenResourceError):
            while await stdin.receive_some(1 << 12):
                pass
    log.info("stdin closed (the parent is stopping us, or has gone): exiting")
    _exit_soon()
    scope.cancel()


async def _exit_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: exiting", signal.Signals(signum).name)
            _exit_soon()
            scope.cancel()
            return


async def run(args: argparse.Namespace, template: str | None, handshake: IO[str]) -> int:
    """Serve until the parent goes or signals us; the exit status."""
    code = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_exit_when_orphaned, nursery.cancel_scope)
        nursery.start_soon(_exit_on_signal, nursery.cancel_scope)
        code = await serve(args, template, handshake)
        nursery.cancel_scope.cancel()
    return code


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m corral.runner", description="Serve one model to the corral server.")
    p.add_argument("--model", required=True, help="path of the GGUF file")
    p.add_argument("--num-parallel", type=int, default=4)
    p.add_argument("--num-ctx", type=int, default=4096)
    p.add_argument("--num-batch", type=int, default=512)
    p.add_argument("--precision", default="auto")
    p.add_argument("--num-thread", type=int, default=0, help="CPU threads for compute (0: torch's default)")
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel", type=int, default=1, help="rank processes the model is split over (corral.parallel)")
    p.add_argument("--pipeline-parallel", type=int, default=1, help="stages the model's blocks are split into (corral.parallel)")
    p.add_argument("--kv-cache-type", default="f16", help="how the KV cache holds keys and values: f16, q8_0 or q4_0")
    p.add_argument("--kv-cache-fallback", action="store_true",
                   help="load with f16 (a warning) when the model cannot take --kv-cache-type (a server-wide setting)")
    p.add_argument("--name", default=None, help="what log lines call the model (default: the file's name)")
    p.add_argument("--keep-context", action="store_true", help="refuse to load rather than lower num_ctx to fit in memory")
    p.add_argument("--template-file", default=None, help="a Jinja chat template to use instead of the file's")
    p.add_argument("--projector", default=None, help="path of a vision projector (mmproj) GGUF to load beside the model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # The handshake gets the real stdout; fd 1 becomes stderr so stray prints land in the parent's log.
    handshake = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    logging.basicConfig(
        level=os.environ.get("CORRAL_RUNNER_LOG_LEVEL", "INFO").upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    template = None
    if args.template_file:
        with open(args.template_file, encoding="utf-8") as f:
            template = f.read()
    # Outside trio.run's signal receiver (its last moments, the shutdown after it) a SIGTERM or SIGINT
    # finds us exiting already: it must not turn a clean exit into a death by signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    return trio.run(run, args, template, handshake)


if __name__ == "__main__":
    sys.exit(main())
