"""N concurrent streaming clients against a running `corral serve`, bounded in time.

    python benchmarks/load.py --url http://127.0.0.1:11434 --model smollm2 [--clients 500] [--duration 60]
        [--num-predict 16] [--soak]   # --soak: keep the clients going for --duration (default 600 s there),
                                      # sampling the server's RSS each minute to show whether it grows

Each client sends /api/generate (streaming) and, in --soak mode, sends again as soon as its answer
ends. Reports completions, 503s (server busy: CORRAL_MAX_QUEUE), other failures (and a few of their
messages), clients still unanswered when the time is up, p50/p99 time to
first token of the completed requests, and the server's RSS (server process plus its runner
processes, from /proc; the server's pid is found by its port) before and after, and the server
process's highest RSS sampled each second while the clients ran (`rss_peak_server_mib`). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import httpx
import trio


def _pid_listening_on(port: int) -> int | None:
    """The pid of the process with a listening socket on `port` (from /proc/net/tcp and fd links)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = str(fd.readlink())
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def _family_rss_mib(pid: int | None) -> dict:
    """RSS of the server and of its descendants (the runners), in MiB."""
    if pid is None:
        return {}
    children: dict[int, list[int]] = {}
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    def rss(p: int) -> float:
        try:
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0
    runners, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        runners.append(p)
        todo.extend(children.get(p, []))
    return {"server_mib": round(rss(pid), 1), "runners_mib": round(sum(rss(p) for p in runners), 1)}


async def _client(http: httpx.AsyncClient, args, results: dict, deadline: float) -> None:
    body = {"model": args.model, "prompt": "Why is the sky blue?", "options": {"num_predict": args.num_predict, "temperature": 0}}
    while trio.current_time() < deadline:
        start = time.perf_counter()
        try:
            async with http.stream("POST", "/api/generate", json=body) as reply:
                if reply.status_code == 503:
                    results["busy"] += 1
                elif reply.status_code != 200:
                    results["failed"] += 1
                    results["errors"].append(f"{reply.status_code}: {(await reply.aread())[:200]!r}")
                else:
                    first = None
                    async for line in reply.aiter_lines():
                        if line and first is None:
                            first = time.perf_counter() - start
                        if line and "error" in json.loads(line):
                            results["failed"] += 1
                            results["errors"].append(json.loads(line)["error"][:200])
                            break
                    else:
                        results["completed"] += 1
                        results["ttft"].append(first or 0.0)
        except httpx.HTTPError as error:
            results["failed"] += 1
            results["errors"].append(repr(error)[:200])
        if not args.soak:
            return


async def run(args) -> dict:
    port = httpx.URL(args.url).port or 11434
    pid = _pid_listening_on(port)
    results = {"completed": 0, "busy": 0, "failed": 0, "ttft": [], "errors": []}
    before = _family_rss_mib(pid)
    samples = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.duration + 60, limits=limits) as http:
        # one request first: the model is loaded before the clock starts
        (await http.post("/api/generate", json={"model": args.model, "prompt": "", "stream": False})).raise_for_status()
        loaded = _family_rss_mib(pid)
        started = time.perf_counter()
        deadline = trio.current_time() + args.duration
        peak = [loaded.get("server_mib", 0.0)]
        with trio.move_on_after(args.duration + 30):
            async with trio.open_nursery() as sampling:
                sampling.start_soon(_sample_peak, pid, peak)
                async with trio.open_nursery() as nursery:
                    for _ in range(args.clients):
                        nursery.start_soon(_client, http, args, results, deadline)
                    if args.soak:
                        while trio.current_time() < deadline:
                            await trio.sleep(min(60, args.duration))
                            samples.append(_family_rss_mib(pid))
                sampling.cancel_scope.cancel()
    ttft = sorted(results.pop("ttft"))
    results["errors"] = sorted(set(results["errors"]))[:5]
    if not args.soak:  # clients with no answer when the time was up
        results["unfinished"] = args.clients - results["completed"] - results["busy"] - results["failed"]
    quantile = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3)) if ttft else (lambda q: None)
    return {
        "clients": args.clients, "seconds": round(time.perf_counter() - started, 1), **results,
        "ttft_p50_s": quantile(0.5), "ttft_p99_s": quantile(0.99),
        "ttft_mean_s": round(statistics.fmean(ttft), 3) if ttft else None,
        "rss_before": before, "rss_loaded": loaded, "rss_after": _family_rss_mib(pid), "rss_samples": samples,
        "rss_peak_server_mib": peak[0],
    }


async def _sample_peak(pid: int | None, peak: list[float]) -> None:
    """The server's highest RSS, sampled each second, into `peak[0]` (the streams it holds cost memory only while open)."""
    while True:
        peak[0] = max(peak[0], _family_rss_mib(pid).get("server_mib", 0.0))
        await trio.sleep(1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:11434")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--duration", type=float, default=None, help="seconds (60; 600 with --soak)")
    parser.add_argument("--num-predict", type=int, default=16)
    parser.add_argument("--soak", action="store_true")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 600.0 if args.soak else 60.0
    figures = trio.run(run, args)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
