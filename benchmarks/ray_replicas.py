"""Throughput of corral.ray with 1 and 2 replicas of smollm2 on a local Ray instance (prints figures only).

    python benchmarks/ray_replicas.py [requests] [concurrency] [max_tokens]
"""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import time

import httpx
import ray
from ray import serve

from corral.ray import ReplicaSettings, build


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one(url: str, index: int, max_tokens: int) -> int:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Tell me about number {index}."}],
            "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def main(requests: int = 16, concurrency: int = 8, max_tokens: int = 32) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    for replicas in (1, 2):
        serve.run(build(ReplicaSettings(model="smollm2", num_replicas=replicas, num_cpus=2 / replicas)), name="bench", route_prefix="/")
        _one(url, -1, 2)  # warm
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(lambda index: _one(url, index, max_tokens), range(requests)))
        elapsed = time.perf_counter() - start
        serve.delete("bench")  # frees its CPUs: an in-place upgrade to 2 replicas would wait for them
        print(f"{replicas} replica(s): {requests} requests, {tokens} tokens in {elapsed:.1f} s: {tokens / elapsed:.1f} tok/s", flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
