"""`corral bench --sweep`: closed-loop load at several concurrency levels through an OpenAI-compatible HTTP API.

The same load runs against corral and, with `--against`, any other OpenAI-compatible server (llama-server,
vLLM, Ollama) in one run, so the figures share the machine's state. Each level keeps `concurrency`
requests in flight until `requests` have finished; every request is a non-streamed /v1/completions of
`max_tokens` greedy tokens with `ignore_eos` (vLLM's and llama.cpp's extra, which corral accepts too), so
every server generates the same number of tokens. Throughput is the level's generated tokens over its
wall time; latency is each request's end-to-end time.
"""

from __future__ import annotations

import json
import time
from typing import Sequence

import attrs
import httpx
import numpy as np
import trio

from corral.bench import BENCH_TEXT
from corral.errors import CorralError

WORDS_PER_TOKEN = 0.75  # English text: the prompt is sized in words, as the API cannot tokenize for another server


class SweepError(CorralError):
    """A server under load answered with an error (or not at all)."""


@attrs.frozen
class Target:
    """One server to load: a label for the plot, its base URL (without /v1) and the model name it serves."""

    label: str
    url: str
    model: str


@attrs.frozen
class SweepPoint:
    """One concurrency level's figures on one server."""

    server: str
    concurrency: int
    requests: int
    prompt_tokens: float  # mean, as the server counted them
    generated_tokens: int
    wall_s: float
    throughput_tok_s: float
    p50_latency_s: float
    p99_latency_s: float


def bench_prompt(prompt_tokens: int) -> str:
    """English text of about `prompt_tokens` tokens."""
    words = BENCH_TEXT.split()
    wanted = max(1, round(prompt_tokens * WORDS_PER_TOKEN))
    return " ".join(words[i % len(words)] for i in range(wanted))


def parse_levels(text: str) -> tuple[int, ...]:
    """"1,2,4,8,16" -> (1, 2, 4, 8, 16); a ValueError names what is wrong."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"concurrency levels must be positive integers separated by commas, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive integers separated by commas, not {text!r}")
    return levels


async def _complete(http: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int) -> tuple[float, int, int]:
    """One request: (latency in seconds, prompt tokens, generated tokens)."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": False}
    start = time.perf_counter()
    try:
        response = await http.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise SweepError(f"{target.label} ({target.url}) did not answer: {exc}") from None
    latency = time.perf_counter() - start
    if response.status_code != 200:
        raise SweepError(f"{target.label} ({target.url}) answered {response.status_code}: {response.text[:300]}")
    usage = response.json().get("usage") or {}
    return latency, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


async def _level(http: httpx.AsyncClient, target: Target, concurrency: int, requests: int, prompt: str, max_tokens: int) -> SweepPoint:
    results: list[tuple[float, int, int]] = []
    remaining = iter(range(requests))

    async def worker() -> None:
        for i in remaining:
            # A distinct head per request, so no request is served from another's cached prefix.
            results.append(await _complete(http, target, f"{i}. {prompt}", max_tokens))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    wall = time.perf_counter() - start
    latencies = np.array([latency for latency, _, _ in results])
    generated = sum(count for _, _, count in results)
    return SweepPoint(
        server=target.label,
        concurrency=concurrency,
        requests=len(results),
        prompt_tokens=float(np.mean([count for _, count, _ in results])),
        generated_tokens=generated,
        wall_s=wall,
        throughput_tok_s=generated / wall,
        p50_latency_s=float(np.percentile(latencies, 50)),
        p99_latency_s=float(np.percentile(latencies, 99)),
    )


async def sweep_target(target: Target, levels: Sequence[int], prompt_tokens: int, max_tokens: int, rounds: int) -> list[SweepPoint]:
    """Every level on one server, after one warm-up request (which loads the model); `rounds` requests per stream."""
    prompt = bench_prompt(prompt_tokens)
    limits = httpx.Limits(max_connections=max(levels) + 1)
    async with httpx.AsyncClient(base_url=target.url.rstrip("/"), timeout=httpx.Timeout(600.0), limits=limits) as http:
        await _complete(http, target, "warm up. " + prompt, 2)
        return [await _level(http, target, level, rounds * level, prompt, max_tokens) for level in levels]


def run_sweep(targets: Sequence[Target], levels: Sequence[int], prompt_tokens: int = 128, max_tokens: int = 128, rounds: int = 4) -> list[SweepPoint]:
    """The sweep on each target in turn (one after the other, never at once)."""

    async def main() -> list[SweepPoint]:
        points: list[SweepPoint] = []
        for target in targets:
            points += await sweep_target(target, levels, prompt_tokens, max_tokens, rounds)
        return points

    return trio.run(main)


def plot_sweep(points: Sequence[SweepPoint], path: str, title: str) -> None:
    """Throughput and p50/p99 latency against concurrency, one line per server, as an image at `path`."""
    import matplotlib  # here: a dependency, but only a plot needs it loaded

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot

    figure, (throughput, latency) = pyplot.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for server in dict.fromkeys(point.server for point in points):
        mine = [point for point in points if point.server == server]
        levels = [point.concurrency for point in mine]
        line = throughput.plot(levels, [p.throughput_tok_s for p in mine], marker="o", label=server)[0]
        latency.plot(levels, [p.p50_latency_s for p in mine], marker="o", color=line.get_color(), label=f"{server} p50")
        latency.plot(levels, [p.p99_latency_s for p in mine], marker="^", linestyle="--", color=line.get_color(), label=f"{server} p99")
    for axes, label in ((throughput, "generated tokens/s (all streams)"), (latency, "request latency (s)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted({p.concurrency for p in points}), labels=[str(c) for c in sorted({p.concurrency for p in points})])
        axes.set_xlabel("concurrent requests")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def points_json(points: Sequence[SweepPoint]) -> str:
    """The figures as a JSON list."""
    return json.dumps([attrs.asdict(point) for point in points], indent=2)
