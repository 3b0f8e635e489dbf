"""Where a batch-1 decode step's time goes: per graph node kind, per torch op, against the bandwidth floor.

    python benchmarks/decode_profile.py [--models smollm2 gemma3:270m] [--context 512] [--steps 40] [--threads 2]

For each model: prefill `--context` tokens, decode a few to record and compile the batch-1 graph,
then over `--steps` more decode steps

* the recorded graph's nodes by what they call (calls a token, and milliseconds a token, each node
  timed alone in an interpreted run of the same node list: the timers add a little a node);
* torch's profiler over the same steps run normally (the compiled plan): aten ops and their calls
  a token, self CPU time a token;
* the step's wall time, and its floor: the bytes the step reads (corral's resident weight bytes and
  the KV cache at this context) over the machine's measured read bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from quant_types import read_bandwidth, type_mix  # noqa: E402 - benchmarks/ is not a package
from side_by_side import kv_bytes_per_cell  # noqa: E402


def node_name(fn) -> str:
    """A readable name for a recorded node's function."""
    if isinstance(fn, functools.partial):
        return node_name(fn.func)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None) or ""
    return f"{module.rsplit('.', 1)[-1]}.{name}" if module and not module.startswith("torch") else f"torch.{name}"


def timed_nodes(graph, steps: int) -> dict[str, list[float]]:
    """Per node name: [calls, seconds] summed over `steps` interpreted runs of the graph's node list."""
    from corral.plugins.backends.torch.graph import Node, Slot

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    bound = graph.bindings
    with torch.inference_mode():
        for _ in range(steps):
            values: list = [None] * len(graph.nodes)
            for i, (fn, args) in enumerate(graph.nodes):
                resolved = [values[a.index] if type(a) is Node else bound[a.name] if type(a) is Slot else a for a in args]
                start = time.perf_counter()
                values[i] = fn(*resolved)
                entry = totals[node_name(fn)]
                entry[0] += 1
                entry[1] += time.perf_counter() - start
    return totals


def profile(name: str, context: int, steps: int) -> dict:
    from corral.bench import prompt_ids
    from corral.engine import load_model
    from corral.model import Batch

    model = load_model(name)
    ids = prompt_ids(model, context)
    cache = model.new_cache(context + 3 * steps + 8)
    logits = model.forward(Batch.single(ids), cache)
    position = context

    def decode(count: int) -> float:
        nonlocal logits, position
        start = time.perf_counter()
        for _ in range(count):
            logits = model.forward(Batch.single([int(np.argmax(logits[-1]))], start=position), cache)
            position += 1
        return (time.perf_counter() - start) / count

    decode(3)  # records the graph, then runs its compiled plan
    step_s = decode(steps)
    graphs = model.backend._graphs._graphs  # the recorded graphs by (rows, outputs)
    _, graph, _ = graphs[(1, 1)]
    nodes = timed_nodes(graph, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(steps)
    ops = [(e.key, e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in prof.key_averages()]
    return {"model": model, "path": model.path, "step_s": step_s, "nodes": nodes, "node_count": len(graph.nodes), "ops": ops, "position": position}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3:270m"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(passes=5)
    gb_s = bandwidth["2 threads" if args.threads > 1 else "1 thread"]["best_gb_s"]
    print(f"read bandwidth: {gb_s:.1f} GB/s ({args.threads} threads, best of 5)")
    for name in args.models:
        p = profile(name, args.context, args.steps)
        weights = type_mix(pathlib.Path(p["path"]))["corral_bytes_per_token"]
        kv = kv_bytes_per_cell(str(p["path"])) * (args.context + args.steps)
        floor_ms = 1e3 * (weights + kv) / (gb_s * 1e9)
        calls = sum(c for c, _ in p["nodes"].values()) / args.steps
        aten_calls = sum(count for _, count, _ in p["ops"])
        print(f"\n### {name}: batch-1 decode at a {args.context}-token context\n")
        print(f"step {1e3 * p['step_s']:.2f} ms ({1 / p['step_s']:.1f} tok/s); floor {floor_ms:.2f} ms "
              f"({(weights + kv) / 1e6:.0f} MB a token: weights {weights / 1e6:.0f}, KV {kv / 1e6:.1f}); "
              f"{p['node_count']} graph nodes, {calls:.0f} node calls and {aten_calls:.0f} aten calls a token\n")
        print("| graph node | calls a token | ms a token (timed alone) |\n|---|---|---|")
        for key, (count, seconds) in sorted(p["nodes"].items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"| {key} | {count / args.steps:.0f} | {1e3 * seconds / args.steps:.3f} |")
        print("\n| aten op (profiler) | calls a token | self CPU ms a token |\n|---|---|---|")
        for key, count, ms in sorted(p["ops"], key=lambda op: -op[2])[: args.top]:
            print(f"| {key} | {count:.0f} | {ms:.3f} |")
        del p


if __name__ == "__main__":
    main()
