"""Run the server: the scheduler and Hypercorn's trio worker in one nursery."""

from __future__ import annotations

import logging
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



async def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    store: Store | None = None,
    scheduler: Scheduler | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `task_status.started()` reports the bound address ("host:port")."""
    store = store or default_store()
    log.info("%s", describe(await trio.to_thread.run_sync(system_info)))
    log_environment(log)
    async with trio.open_nursery() as nursery:
        scheduler = await nursery.start((scheduler or Scheduler(store)).run)
        config = Config()
        config.bind = [f"{host}:{port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")  # through corral's structured handler
        config.graceful_timeout = 1.0
        guard = Guard.from_env(host)
        if warning := exposure_warning(host, guard.api_key):
            log.warning("%s", warning)
        app = create_app(scheduler, store, nursery, guard)
        binds = await nursery.start(hypercorn_serve, app, config)
        log.info("corral listening on %s", binds)
        task_status.started(binds[0].removeprefix("http://") if binds else f"{host}:{port}")


async def serve_until_signalled(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """`serve` until SIGINT or SIGTERM; then every model is unloaded and every runner process reaped."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, host, port)
            async for received in signals:
                log.info("received %s: unloading models and stopping", signal.Signals(received).name)
                nursery.cancel_scope.cancel()
                break
