"""Run the server: the scheduler and Hypercorn's trio worker in one nursery.

Stopping (SIGTERM or SIGINT): the listeners close at once, running requests get a grace period
(CORRAL_SHUTDOWN_GRACE seconds, 10 by default) to finish, then the runners are stopped, which ends
any stream still going with an error line; then the server exits. A second signal stops it at once.
"""

from __future__ import annotations

import logging
import os
import signal

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from corral.address import DEFAULT_HOST, DEFAULT_PORT
from corral.discover import describe, system_info
from corral.logs import log_environment
from corral.scheduler import Scheduler
from corral.server.app import create_app
from corral.server.guard import Guard, exposure_warning
from corral.store import Store, default_store

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds running requests may take to finish once the server is stopping
CLOSE_MARGIN = 5.0  # after the runners stop, how long connections have to send their last line


def shutdown_grace() -> float:
    """CORRAL_SHUTDOWN_GRACE in seconds, else 10."""
    value = os.environ.get("CORRAL_SHUTDOWN_GRACE", "").strip()
    try:
        return max(0.0, float(value)) if value else DEFAULT_SHUTDOWN_GRACE
    except ValueError:
        log.warning("CORRAL_SHUTDOWN_GRACE=%r is not a number of seconds; using %g", value, DEFAULT_SHUTDOWN_GRACE)
        return DEFAULT_SHUTDOWN_GRACE


async def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    store: Store | None = None,
    scheduler: Scheduler | None = None,
    stopping: trio.Event | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled, or until `stopping` is set and the running requests are done (or their grace is
    over); `task_status.started()` reports the bound address ("host:port")."""
    store = store or default_store()
    log.info("%s", describe(await trio.to_thread.run_sync(system_info)))
    log_environment(log)
    async with trio.open_nursery() as nursery:
        scheduler = await nursery.start((scheduler or Scheduler(store)).run)
        config = Config()
        config.bind = [f"{host}:{port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")  # through corral's structured handler
        grace = shutdown_grace()
        config.graceful_timeout = grace + CLOSE_MARGIN  # hypercorn's own limit, a backstop behind _drain's
        guard = Guard.from_env(host)
        if warning := exposure_warning(host, guard.api_key):
            log.warning("%s", warning)
        app = create_app(scheduler, store, nursery, guard)
        stopping = trio.Event() if stopping is None else stopping
        http_done = trio.Event()
        binds = await nursery.start(_serve_http, app, config, stopping, http_done)
        log.info("corral listening on %s", binds)
        nursery.start_soon(_drain, scheduler, stopping, http_done, grace, nursery.cancel_scope)
        task_status.started(binds[0].removeprefix("http://") if binds else f"{host}:{port}")


async def _serve_http(app, config: Config, stopping: trio.Event, done: trio.Event, task_status=trio.TASK_STATUS_IGNORED) -> None:
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stopping.wait, task_status=task_status)
    finally:
        done.set()


async def _drain(
    scheduler: Scheduler, stopping: trio.Event, http_done: trio.Event, grace: float, scope: trio.CancelScope
) -> None:
    """Once stopping: requests finish within `grace`, the runners stop (ending what still runs), then everything ends."""
    await stopping.wait()
    with trio.move_on_after(grace) as waited:
        await scheduler.drain()
    if waited.cancelled_caught:
        log.warning("requests still running %g s after the stop began: ending them", grace)
    await scheduler.stop_all()
    with trio.move_on_after(CLOSE_MARGIN):
        await http_done.wait()  # each ended stream has sent its error line and closed
    scope.cancel()


async def serve_until_signalled(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """`serve` until SIGINT or SIGTERM, stopping gracefully (see the module's docstring); every runner process is reaped."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            stopping = trio.Event()
            nursery.start_soon(_stop_on_signals, signals, stopping, nursery.cancel_scope)
            await serve(host, port, stopping=stopping)
            nursery.cancel_scope.cancel()  # served and drained: the signal watcher goes too


async def _stop_on_signals(signals, stopping: trio.Event, scope: trio.CancelScope) -> None:
    async for received in signals:
        if stopping.is_set():
            log.info("received %s again: stopping now", signal.Signals(received).name)
            scope.cancel()
            return
        log.info("received %s: no new requests; running ones have %g s to finish", signal.Signals(received).name, shutdown_grace())
        stopping.set()
