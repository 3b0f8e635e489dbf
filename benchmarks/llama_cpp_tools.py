"""llama.cpp's own C++ tools as the benchmarks' anchors: built from the llama-cpp-python sdist, then run.

`tool(name)` is the path of a built binary (`llama-bench`, `llama-server`, ...) under the peers
cache's build directory (CORRAL_PEERS, default ~/.cache/corral-peers; see ../shared/peers.md),
configuring and building only the missing targets from the sdist's vendored llama.cpp (downloaded
once by tests/peers.py); about 7 minutes on 2 cores for the first one. Binaries already there are
never rebuilt or removed. `llama_bench` runs llama-bench and reads its JSON; `LlamaServer` runs
llama-server on a free loopback port for as long as a `with` block lasts.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import peers  # noqa: E402 - tests/peers.py: the sdist's download and cache

# The configuration peers.md gives: this CPU's instructions, no network code, no tests.
CMAKE_OPTIONS = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]
# ggml's AMX matmuls (built where -march=native has AMX) died in `ldtilecfg` on an OpenMP worker
# thread on a Firecracker VM of Intel Xeons whose AMX works in a plain program (2026-12-03): with
# `no_amx` the tools are built without it, into their own directory, and take the AVX-512 paths.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
no_amx = False  # set by side_by_side.py's --llama-cpp-no-amx


def build_dir() -> pathlib.Path:
    return peers.cache_dir() / ("build-noamx" if no_amx else "build")


def cmake_options() -> list[str]:
    if not no_amx:
        return CMAKE_OPTIONS
    return [*CMAKE_OPTIONS, f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]


def tool(name: str, jobs: int | None = None) -> pathlib.Path:
    """The built binary `name` of llama.cpp, built from the sdist first when it is missing."""
    binary = build_dir() / "bin" / name
    if binary.is_file():
        return binary
    build, sources = build_dir(), peers.llama_cpp_sources()
    if not (build / "CMakeCache.txt").is_file():
        _run(["cmake", "-S", str(sources), "-B", str(build), *cmake_options()], f"configuring llama.cpp in {build}")
    jobs = jobs or os.cpu_count() or 2
    _run(["cmake", "--build", str(build), "--target", name, f"-j{jobs}"], f"building {name} (minutes)")
    if not binary.is_file():
        raise RuntimeError(f"building {name} finished without {binary}")
    return binary


def _run(command: list[str], what: str) -> None:
    print(f"{what}: {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def llama_bench(path: str, threads: int, prompt_tokens: int, gen_tokens: int, depths: tuple[int, ...] = (0,), repetitions: int = 1) -> dict:
    """llama-bench's prefill and decode tok/s on `path`: `prefill_tok_s` and `decode_tok_s` at depth 0,
    `decode_tok_s_at_<d>` for each other depth (tokens already in the context when decoding starts)."""
    command = [
        str(tool("llama-bench")), "-m", path, "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens),
        "-d", ",".join(map(str, depths)), "-r", str(repetitions), "-o", "json",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        hint = ""
        if done.returncode < 0 and not no_amx:  # killed by a signal: on a VM, maybe ggml's AMX code (NO_AMX_FLAGS)
            hint = " (killed by a signal; if this CPU has AMX, try side_by_side.py --llama-cpp-no-amx)"
        raise RuntimeError(f"llama-bench failed on {path} with {done.returncode}{hint}:\n{done.stderr[-3000:]}")
    figures = {}
    for test in json.loads(done.stdout):
        depth = test.get("n_depth", 0)
        key = "prefill_tok_s" if test["n_prompt"] else "decode_tok_s"
        figures[key if depth == 0 else f"{key}_at_{depth}"] = test["avg_ts"]
    return figures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, seconds: float = 300) -> None:
    """Poll `url` until it answers 200; an error if the process exits first or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer from {url} within {seconds:.0f} s")


def stop(process: subprocess.Popen | None, seconds: float) -> None:
    """SIGTERM a server started here, SIGKILL it after `seconds`, and reap it."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LlamaServer:
    """`llama-server -m PATH -np SLOTS -c SLOTS*CTX` on a free loopback port (`base_url`) inside a `with` block."""

    def __init__(self, path: str, slots: int, slot_context: int, threads: int):
        self.command = [
            str(tool("llama-server")), "-m", path, "-np", str(slots), "-c", str(slots * slot_context), "-t", str(threads),
            "-tb", str(threads), "--host", "127.0.0.1", "--port", "0",
        ]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        port = free_port()
        self.command[-1] = str(port)
        self.base_url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_up(self.base_url + "/health", self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.process, 20)
