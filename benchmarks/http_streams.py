"""Concurrent greedy streams over HTTP, the same for `corral serve` and `llama-server`.

`stream_prompts` makes N distinct prompts of about P tokens of English text (a distinct first word
each, so no stream reuses another's prefix). `run_streams` sends all of them at once, each
streaming, greedy, generating exactly G tokens (`ignore_eos`), and measures what a client sees:
generated tokens / wall time (prefill of the prompts included), the time to first token and each
stream's token rate after it. corral is asked through Ollama's `/api/generate` (raw, NDJSON),
llama-server through its native `/completion` (SSE): both report their own token counts, which
the figures use. `CorralServer` runs `corral serve` on a free loopback port inside a `with` block.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import trio

from llama_cpp_tools import free_port, stop, wait_until_up

TEXT = (
    "The history of astronomy spans thousands of years, from the first people who tracked the moon "
    "and planets to the telescopes that map galaxies billions of light years away. "
)
WORDS = ["Once", "Today", "Long", "Here", "Every", "Some", "Many", "Before", "After", "Then", "Still", "Now"]


def stream_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` distinct texts of `tokens` tokens by `tokenizer` (a corral Tokenizer; special tokens excluded)."""
    prompts = []
    for i in range(count):
        ids = tokenizer.encode(f"{WORDS[i % len(WORDS)]} {i}: " + TEXT * (tokens // 8 + 1), add_special=False)
        prompts.append(tokenizer.decode(ids[:tokens]))
    return prompts


class CorralServer:
    """`corral serve` with N parallel sequences of `slot_context` cells on a free loopback port, the model kept loaded."""

    def __init__(self, slots: int, slot_context: int, threads: int = 0):
        self.env = {**os.environ, "CORRAL_NUM_PARALLEL": str(slots), "CORRAL_CONTEXT_LENGTH": str(slot_context), "CORRAL_KEEP_ALIVE": "-1"}
        if threads:  # else torch's default: every core
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> CorralServer:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-c", "from corral.cli import main; main()", "serve"]
        env = {**self.env, "CORRAL_HOST": f"127.0.0.1:{port}"}
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_up(self.base_url + "/", self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.process, 30)


def corral_request(model: str, prompt: str, gen_tokens: int) -> tuple[str, dict]:
    options = {"temperature": 0, "num_predict": gen_tokens, "ignore_eos": True}
    return "/api/generate", {"model": model, "prompt": prompt, "raw": True, "stream": True, "options": options}


def llama_server_request(prompt: str, gen_tokens: int) -> tuple[str, dict]:
    body = {"prompt": prompt, "n_predict": gen_tokens, "ignore_eos": True, "temperature": 0, "stream": True, "cache_prompt": False}
    return "/completion", body


def corral_events(line: str) -> dict | None:
    """One NDJSON line of /api/generate as {token, done, prompt_tokens, generated}."""
    if not line.strip():
        return None
    chunk = json.loads(line)
    if "error" in chunk:
        raise RuntimeError(f"corral: {chunk['error']}")
    if chunk.get("done"):
        return {"done": True, "prompt_tokens": chunk.get("prompt_eval_count", 0), "generated": chunk.get("eval_count", 0)}
    return {"done": False}


def llama_server_events(line: str) -> dict | None:
    """One SSE line of llama-server's /completion as {token, done, prompt_tokens, generated}."""
    if not line.startswith("data: "):
        return None
    chunk = json.loads(line[len("data: ") :])
    if chunk.get("stop"):
        timings = chunk.get("timings", {})
        return {"done": True, "prompt_tokens": chunk.get("tokens_evaluated", timings.get("prompt_n", 0)),
                "generated": chunk.get("tokens_predicted", timings.get("predicted_n", 0))}
    return {"done": False}


async def one_stream(client: httpx.AsyncClient, request: tuple[str, dict], parse, started: float) -> dict:
    """Send one streaming request; the times of its first and last chunk and the server's counts."""
    first = None
    final: dict = {}
    path, body = request
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            event = parse(line)
            if event is None:
                continue
            if first is None:
                first = time.perf_counter()
            if event["done"]:
                final = event
    end = time.perf_counter()
    return {"first_s": (first or end) - started, "end_s": end - started, **final}


async def _streams(base_url: str, requests: list[tuple[str, dict]], parse) -> list[dict]:
    results: list[dict] = [{}] * len(requests)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=httpx.Limits(max_connections=len(requests))) as client:
        started = time.perf_counter()

        async def run(i: int) -> None:
            results[i] = await one_stream(client, requests[i], parse, started)

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(run, i)
    return results


def run_streams(base_url: str, requests: list[tuple[str, dict]], parse) -> dict:
    """All `requests` at once; aggregate tok/s, median time to first token, median per-stream decode tok/s."""
    results = trio.run(_streams, base_url, requests, parse)
    wall = max(r["end_s"] for r in results)
    generated = sum(r["generated"] for r in results)
    rates = [(r["generated"] - 1) / (r["end_s"] - r["first_s"]) for r in results if r["generated"] > 1 and r["end_s"] > r["first_s"]]
    return {
        "streams": len(results),
        "generated_tokens": generated,
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in results),
        "wall_s": wall,
        "aggregate_tok_s": generated / wall,
        "ttft_ms": 1e3 * statistics.median(r["first_s"] for r in results),
        "stream_tok_s": statistics.median(rates) if rates else 0.0,
    }


def warm_up(base_url: str, request: tuple[str, dict], parse) -> None:
    """One short request: loads corral's model, records llama-server's first graphs."""
    run_streams(base_url, [request], parse)
