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


def test_large_buffers_are_reused_instead_of_mapped_afresh_each_time():
    # A step's activations: twenty 4 MB buffers (20480 pages) made and freed, round after round.
    # glibc's dynamic thresholds sometimes unmap them all on free, so that every round faults them
    # in again; with corral's fixed thresholds the heap keeps them. The heap settles within a few
    # rounds (until then a fragment of it may be faulted in again: up to 6144 pages seen), so the
    # steady state is what is checked: the failure unmaps all of them in every round.
    import subprocess
    import sys

    script = """
import resource, sys, torch
from corral.memory import reuse_large_buffers
if sys.argv[1] == "reuse":
    reuse_large_buffers()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(1 << 20).fill_(1.0) for _ in range(20)]
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[5:]))
"""
    for _ in range(3):
        faults = int(subprocess.run([sys.executable, "-c", script, "reuse"], capture_output=True, text=True, check=True).stdout)
        assert faults < 20480 // 4, f"{faults} pages faulted in again once the heap had settled"
