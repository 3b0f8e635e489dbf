"""The server routes and its runner processes compute: `corral serve` never imports torch and stays small."""

import subprocess
import sys

import httpx
import pytest
from conftest import TINY_LLAMA
from serve_process import ServeProcess, children_of, maps_torch, resident_mib

pytestmark = pytest.mark.slow  # server and runner processes: out of the fast subset (-m "not slow")

SERVER_RSS_LIMIT_MIB = 80


def test_the_server_process_never_imports_torch_and_stays_under_80_mb(tiny_store_root, tmp_path):
    with ServeProcess(tiny_store_root) as served:
        body = {"model": TINY_LLAMA, "prompt": "Hi", "stream": False, "format": "json", "options": {"num_predict": 3}}
        reply = httpx.post(served.url + "/api/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
            "model": TINY_LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        }).raise_for_status()
        httpx.get(served.url + "/metrics", timeout=30).raise_for_status()
        runners = children_of(served.pid)
        assert runners and any(maps_torch(pid) for pid in runners)  # the model is computed, elsewhere
        assert not maps_torch(served.pid)
        assert resident_mib(served.pid) < SERVER_RSS_LIMIT_MIB


def test_the_server_starts_without_the_native_libraries_only_runners_and_creates_need():
    """tokenizers and llguidance (~8 MB of the server's RSS) load with the first create or constrained request, not at start."""
    probe = "import sys, corral.server.serve, corral.server.app; print(sorted({'torch', 'tokenizers', 'llguidance'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
