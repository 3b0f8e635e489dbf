"""A corral server running in a thread of its own: what each Ray Serve replica owns.

Ray Serve runs a replica's methods on an asyncio loop; corral is Trio. Rather than bridge the two call by
call, the replica starts corral's own server (scheduler, runners, Quart-Trio app on Hypercorn) on a free
loopback port in a Trio thread and hands it each request as HTTP. corral's validation, errors and response
shapes are therefore exactly `corral serve`'s, and nothing here re-implements them.
"""

from __future__ import annotations

import logging
import threading

import attrs
import trio

from corral.errors import CorralError
from corral.scheduler import Scheduler
from corral.server.serve import serve
from corral.store import Store, default_store

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds the server has to bind its port (discovery, plugins; the model loads later)


class ServerStartError(CorralError):
    """The replica's corral server did not start."""


@attrs.define
class ThreadedServer:
    """`corral serve` on 127.0.0.1:<free port>, run by `trio.run` in a daemon thread until `stop()`."""

    store_root: str | None = None
    runner: str | None = None  # the scheduler's runner kind ("process", "inprocess"); None: CORRAL_RUNNER or "process"
    url: str = ""
    _thread: threading.Thread | None = None
    _token: trio.lowlevel.TrioToken | None = None
    _stopping: trio.Event | None = None
    _ready: threading.Event = attrs.Factory(threading.Event)
    _error: BaseException | None = None

    def start(self) -> str:
        """Start the server and wait until it listens; returns its base URL."""
        self._thread = threading.Thread(target=self._run, name="corral-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise ServerStartError(f"the corral server did not start within {START_TIMEOUT:g} s")
        if self._error is not None:
            raise ServerStartError(f"the corral server did not start: {self._error}") from self._error
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        """Stop gracefully (running requests finish, runners are reaped) and wait for the thread."""
        if self._token is not None and self._stopping is not None:
            try:
                self._token.run_sync_soon(self._stopping.set)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the server's thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # noqa: BLE001 - reported to start() or logged: this thread's last act
            self._error = error
            log.exception("the replica's corral server stopped")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stopping = trio.Event()
        store = Store(self.store_root) if self.store_root else default_store()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, "127.0.0.1", 0, store, Scheduler(store, runner=self.runner), self._stopping)
            self.url = f"http://{address}"
            self._ready.set()
