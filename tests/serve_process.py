"""`corral serve` as a real child process, for tests of what only a process shows: its memory, its
imports, its signals and the children it leaves behind.

    with ServeProcess(store_root, env={"OLLAMA_NUM_PARALLEL": "2"}) as served:
        httpx.get(served.url + "/api/ps")
        served.terminate()            # SIGTERM; `served.returncode` and `served.output` afterwards
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

START_TIMEOUT = 60.0


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), zombies excluded."""
    parents: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def resident_mib(pid: int) -> float:
    """VmRSS of a process in MiB."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's native library mapped, i.e. has imported torch."""
    return "libtorch" in pathlib.Path(f"/proc/{pid}/maps").read_text()


class ServeProcess:
    """`python -m corral.cli serve` on a free loopback port over the store at `root`, with runner processes
    as a user's server has (the test session's default is in-process). `python_args` replace `-m corral.cli serve`
    (a `-c` program that runs the CLI after setting something up)."""

    def __init__(
        self, root: pathlib.Path, env: dict[str, str] | None = None, host_env: str = "CORRAL_HOST",
        python_args: tuple[str, ...] = ("-m", "corral.cli", "serve"),
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "CORRAL_MODELS": str(root), "CORRAL_RUNNER": "process", host_env: f"127.0.0.1:{self.port}", **(env or {})}
        if host_env != "CORRAL_HOST":
            self.env.pop("CORRAL_HOST", None)
        self.python_args = python_args
        self.process: subprocess.Popen | None = None
        self.output = ""

    def __enter__(self) -> ServeProcess:
        self.process = subprocess.Popen(
            [sys.executable, *self.python_args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.output = self.process.stdout.read()
                raise AssertionError(f"corral serve exited with {self.process.returncode}:\n{self.output}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                return self
            except httpx.TransportError:
                time.sleep(0.2)
        self.kill()
        raise AssertionError(f"corral serve did not answer within {START_TIMEOUT:g} s:\n{self.output}")

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit (its status) and collect what it printed."""
        self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            self.output += self.process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"corral serve did not exit within {timeout:g} s:\n{self.output}") from None
        return self.process.returncode

    def kill(self) -> None:
        for pid in [self.pid, *children_of(self.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.output += self.process.communicate()[0] or ""

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.kill()
