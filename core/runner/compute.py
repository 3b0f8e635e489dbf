"""The one thread that runs a process's tensor work: model loading, forward steps, sampling.

torch's CPU kernels parallelise with OpenMP, and libgomp keeps a team of worker threads for every
thread that has run a parallel region. Once two such threads exist there are more OpenMP threads
than cores, libgomp stops spinning between regions, and every small op pays a thread wake-up
(a decode step more than twice as slow on another thread; measured: BENCHMARKS.md,
core/runner/compute.py). So all tensor work goes through this single thread, and Trio tasks
await it without blocking the event loop.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any, Callable

import trio

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _compute_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-compute")
        return _executor


async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on the compute thread; like `trio.to_thread.run_sync`, it finishes even if cancelled."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future = _compute_executor().submit(functools.partial(fn, *args, **kwargs))
    future.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.CancelScope(shield=True):  # the work cannot be stopped half way; a cancel lands after it
        await done.wait()
    return future.result()
