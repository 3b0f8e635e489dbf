"""The compute thread: every piece of tensor work of a process runs on one thread, off the event loop."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from corral.runner import compute


async def test_all_work_runs_on_one_thread_that_is_not_the_event_loops():
    first = await compute.run(threading.get_ident)
    second = await compute.run(threading.get_ident)
    assert first == second != threading.get_ident()


async def test_arguments_and_results_pass_through():
    assert await compute.run(pow, 2, 10) == 1024 and await compute.run(int, "ff", base=16) == 255


async def test_an_exception_reaches_the_caller():
    with pytest.raises(ZeroDivisionError):
        await compute.run(lambda: 1 / 0)


async def test_a_cancelled_caller_waits_for_the_work_to_finish():
    finished = []

    def work():
        time.sleep(0.2)
        finished.append(True)

    with trio.move_on_after(0.01) as scope:
        await compute.run(work)
        assert finished == [True]  # the work ran to its end although the deadline passed
        await trio.sleep(0)  # the cancellation lands at the caller's next checkpoint
    assert scope.cancelled_caught


@pytest.mark.slow  # a subprocess that imports torch
def test_large_buffers_are_reused_instead_of_mapped_afresh_each_time():
    # A step's activations: twenty 4 MB buffers (20480 pages) made, written and freed, round after
    # round, through glibc's malloc as torch's CPU allocator does. With glibc's own thresholds this
    # unmaps them all on free, so that every round faults them in again (20448 pages a round, every
    # round); with corral's fixed thresholds the heap keeps them. The steady state is checked
    # (rounds 3 to 6): through torch, whose other allocations interleave, the heap took up to three
    # rounds to settle.
    import subprocess
    import sys

    script = """
import ctypes, resource, sys
from corral.memory import reuse_large_buffers
reuse_large_buffers()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 4 << 20
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(size + 64) for _ in range(20)]
    for pointer in buffers:
        ctypes.memset(pointer, 1, size)
    for pointer in buffers:
        libc.free(pointer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[2:]))
"""
    faults = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert faults < 20480 // 4, f"{faults} pages faulted in again once the heap had settled"
