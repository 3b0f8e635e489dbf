"""Faults: runner processes that die or fail to load, and a server that stops cleanly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import trio

from corral.scheduler import Scheduler
from corral.server.serve import serve
from corral.store import MODEL_MEDIA_TYPE, Store
from conftest import copy_store
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.real_model  # every test here uses a real model: the fast subset does not even import this module


COUNTING = "1, 2, 3, 4, 5,"  # a raw prompt that keeps generating until num_predict


@pytest.fixture
def store(seeded_store_root, tmp_path) -> Store:
    return Store(copy_store(seeded_store_root, tmp_path / "models"))


async def process_server(nursery, store) -> str:
    address = await nursery.start(serve, "127.0.0.1", 0, store, Scheduler(store, runner="process"))
    return f"http://{address}"


def runner_pids(parent: int) -> list[int]:
    """Child processes of `parent` (the runners)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


async def test_killing_the_runner_mid_stream_ends_the_request_with_an_error_line(nursery, store):
    url = await process_server(nursery, store)
    body = {"model": "smollm2", "prompt": COUNTING, "raw": True, "options": {"num_predict": 400}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        lines = []
        async with http.stream("POST", "/api/generate", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(json.loads(line))
                if len(lines) == 3:
                    for pid in runner_pids(os.getpid()):
                        os.kill(pid, signal.SIGKILL)
        assert "error" in lines[-1] and "SIGKILL" in lines[-1]["error"]
        again = await http.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 3}})
        assert again.status_code == 200 and again.json()["done"]
        # /metrics counts the runner that died (here rather than in a test of its own: runner start-ups are slow).
        metrics = (await http.get("/metrics")).text
        assert 'corral_runner_restarts_total{model="smollm2:latest"} 1.0' in metrics


async def test_killing_the_runner_before_a_non_streamed_answer_is_a_500(nursery, store):
    url = await process_server(nursery, store)
    body = {"model": "smollm2", "prompt": COUNTING, "raw": True, "stream": False, "options": {"num_predict": 400}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await http.post("/api/generate", json={"model": "smollm2", "prompt": ""})  # load
        async with trio.open_nursery() as killer:

            async def kill_soon():
                await trio.sleep(1.0)
                for pid in runner_pids(os.getpid()):
                    os.kill(pid, signal.SIGKILL)

            killer.start_soon(kill_soon)
            response = await http.post("/api/generate", json=body)
        assert response.status_code == 500 and "SIGKILL" in response.json()["error"]
        health = await http.get("/health")
        assert health.status_code == 200


def write_unknown_tokenizer(path):
    write_tiny_llama(path)
    path.write_bytes(path.read_bytes().replace(b"gpt2", b"gpt9"))  # tokenizer.ggml.model: one corral cannot read


@pytest.mark.parametrize(
    ("write", "expected"),
    [
        # the server reads the header itself (to size the model) and says what is wrong
        (lambda path: path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64), "truncated"),
        # no installed architecture runs it: the server knows before starting a runner
        (lambda path: write_tiny_llama(path, architecture="mystery"), "architecture 'mystery' is not supported"),
        # a file the server can size but the runner process cannot load: the runner's own error comes back
        (write_unknown_tokenizer, "runner failed to load"),
    ],
)
async def test_a_model_that_fails_to_load_reports_why_and_the_server_stays_healthy(nursery, store, tmp_path, write, expected):
    broken = tmp_path / "broken.gguf"
    write(broken)
    digest = store.write_blob(broken)
    store.write_manifest("broken", [(MODEL_MEDIA_TYPE, digest)])
    url = await process_server(nursery, store)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        failed = await http.post("/api/generate", json={"model": "broken", "prompt": "Hi", "stream": False})
        assert failed.status_code == 500
        assert expected in failed.json()["error"]
        ok = await http.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
        assert ok.status_code == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_server_shutdown_leaves_no_runner_process(store, stop_signal):
    port = free_port()
    env = {**os.environ, "CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_MODELS": str(store.root), "CORRAL_RUNNER": "process"}
    server = subprocess.Popen([sys.executable, "-m", "corral.cli", "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        response = httpx.post(f"{url}/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}, timeout=120)
        assert response.status_code == 200
        runners = runner_pids(server.pid)
        assert runners, "the model should run in a child process"
        server.send_signal(stop_signal)
        assert server.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in runners) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in runners)
    finally:
        if server.poll() is None:
            server.kill()
