"""SIGTERM on `corral serve`: no new connections, running streams finish within the grace period or end
with an error line, runners stop, exit status 0, no process left behind. The server here is bound
through OLLAMA_HOST, which proves that setting too."""

import json
import os
import threading
import time

import httpx
import pytest
from conftest import TINY_LLAMA
from serve_process import ServeProcess, children_of

pytestmark = pytest.mark.slow  # a corral serve process: out of the fast subset (-m "not slow")


GRACE = 4.0


def stream(url: str, options: dict, lines: list, started: threading.Event) -> None:
    """POST /api/generate streaming; every parsed line lands in `lines`."""
    body = {"model": TINY_LLAMA, "prompt": "Hi", "options": {"temperature": 0, **options}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line:
                lines.append(json.loads(line))
                started.set()


def test_sigterm_lets_short_streams_finish_ends_endless_ones_and_exits_cleanly(tiny_store_root):
    env = {"CORRAL_SHUTDOWN_GRACE": str(GRACE), "OLLAMA_NUM_PARALLEL": "2"}
    with ServeProcess(tiny_store_root, env=env, host_env="OLLAMA_HOST") as served:
        # ~1 s of tokens, and a stream that never ends alone (ignore_eos, the context shifted forever)
        short, endless = [], []
        short_started, endless_started = threading.Event(), threading.Event()
        httpx.post(served.url + "/api/generate", json={"model": TINY_LLAMA, "prompt": "", "stream": False}, timeout=120)
        threads = [
            threading.Thread(target=stream, args=(served.url, {"num_predict": 60, "ignore_eos": True}, short, short_started)),
            threading.Thread(target=stream, args=(served.url, {"num_predict": -1, "ignore_eos": True}, endless, endless_started)),
        ]
        for thread in threads:
            thread.start()
        assert short_started.wait(60) and endless_started.wait(60)
        family = children_of(served.pid)
        assert family  # the runner process
        stopped_at = time.monotonic()
        served.process.send_signal(15)
        time.sleep(0.5)
        try:
            httpx.get(served.url + "/api/tags", timeout=5)
            refused = False
        except httpx.TransportError:
            refused = True
        assert served.wait(GRACE + 30) == 0, served.output
        took = time.monotonic() - stopped_at
        for thread in threads:
            thread.join(30)
    assert refused, "the server accepted a new connection while stopping"
    assert short[-1]["done"] is True and short[-1]["eval_count"] == 60
    assert "error" in endless[-1] and not endless[-1].get("done")
    assert GRACE <= took < GRACE + 20
    assert not [pid for pid in family if os.path.exists(f"/proc/{pid}") and _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
