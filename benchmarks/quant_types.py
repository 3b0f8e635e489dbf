"""Decode and prefill speed per quant type, corral against llama.cpp on the same files, beside the memory-bandwidth floor.

    python benchmarks/quant_types.py --make                # build the files from one float source
    python benchmarks/quant_types.py --rounds 2 [--threads 1 2] [--json results.json]
    python benchmarks/quant_types.py --rounds 0 --kernels [--threads 1 2]

`--make` dequantizes the source model (the store's smollm2 unless --source) to one F32 file with
llama-quantize, then quantizes every type below from it; --dir holds them (never the repository).
A run prints each file's tensor type mix (what llama-quantize chose: a type falls back to another
for rows whose width is not a multiple of its block) and the bits a weight in the file and
resident in corral; the read bandwidth of this machine; then in each round, for every file and
thread count in turn, `corral bench FILE --prompt-tokens P --gen-tokens N --json` (its threads set
by OMP_NUM_THREADS) and `llama-bench -m FILE -t T -p P -n N -r 3`, each in a fresh process, which
one goes first alternating from round to round, with the load average before each. The floor
beside a decode figure is the most the measured bandwidth (with as many threads) allows:
bandwidth / the bytes the engine reads a token (corral: its resident weight bytes, whose embedding
is the file's memory map and read a row a token; llama.cpp: the file's tensor bytes, the embedding
counted only when it is also the output matrix).

`--kernels` times, in this process, one decode row through every linear and the logits of each
file as the torch backend loads them, every weight once a pass as in a decode step (medians of
20 passes): milliseconds a token in the matrix products alone and the rate at which each layout
reads its bytes, to set against the measured decode time. (The graph fuses q/k/v and gate/up into
one product each; the bytes are the same.)

Accuracy per file is benchmarks/accuracy.py's --reference mode on the same files.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

PEERS = pathlib.Path.home() / ".cache" / "corral-peers"
# The file's name, llama-quantize's type and its extra arguments.
TYPES = [
    ("Q4_K_M", "Q4_K_M", []),
    ("Q5_K_M", "Q5_K_M", []),
    ("Q8_0", "Q8_0", []),
    ("IQ4_XS", "IQ4_XS", []),
    # llama-quantize offers MXFP4 only as MXFP4_MOE (experts MXFP4, everything else Q8_0); the
    # override puts every block's linear in MXFP4, leaving the (tied) embedding Q8_0.
    ("MXFP4", "MXFP4_MOE", ["--tensor-type", r"blk\.=mxfp4"]),
]


def make_files(quantize: pathlib.Path, source: pathlib.Path, out: pathlib.Path, stem: str) -> None:
    """The F32 file from `source`, then every type of TYPES from that F32 file."""
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"{stem}-F32.gguf"
    commands = [[str(quantize), "--allow-requantize", str(source), str(f32), "F32", "2"]]
    commands += [[str(quantize), *extra, str(f32), str(out / f"{stem}-{name}.gguf"), qtype, "2"] for name, qtype, extra in TYPES]
    for command in commands:
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"llama-quantize failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def type_mix(path: pathlib.Path) -> dict:
    """Per GGML type: tensors and weights in the file; bits a weight in the file and resident in corral, with corral's layouts."""
    from corral.gguf import GGUFFile
    from corral.registry import Plugins

    plugins = Plugins()
    gguf = GGUFFile.open(path)
    backend = plugins.open_backend()
    plan = plugins.architecture_for(gguf).tensor_plan(gguf)
    tensors, weights = collections.Counter(), collections.Counter()
    for info in gguf.tensors.values():
        tensors[info.qtype.name] += 1
        weights[info.qtype.name] += math.prod(info.shape)
    layouts = collections.Counter(f"{info.qtype.name} {role} -> {backend.layout(info, role)}" for info, role in plan if role != "vector")
    total_weights = sum(weights.values())
    file_bytes = sum(info.nbytes for info in gguf.tensors.values())
    has_output = "output.weight" in gguf.tensors
    embedding = gguf.tensors.get("token_embd.weight")
    read_per_token = file_bytes - (embedding.nbytes if embedding is not None and has_output else 0)
    resident = backend.resident_bytes(plan)
    return {
        "types": {name: [tensors[name], weights[name]] for name in tensors},
        "weights": total_weights,
        "file_bits_per_weight": 8 * file_bytes / total_weights,
        "corral_bits_per_weight": 8 * resident / total_weights,
        "corral_layouts": dict(layouts),
        "llama_cpp_bytes_per_token": read_per_token,
        "corral_bytes_per_token": resident,
    }


def read_bandwidth(size: int = 1 << 30, passes: int = 10) -> dict:
    """GB/s of reading a 1 GiB float64 array (numpy's sum), one thread and two threads on halves: best and median of `passes`."""
    array = np.ones(size // 8)
    halves = np.array_split(array, 2)

    def two_threads() -> None:
        threads = [threading.Thread(target=half.sum) for half in halves]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    figures = {}
    for name, read in [("1 thread", array.sum), ("2 threads", two_threads)]:
        seconds = []
        for _ in range(passes):
            start = time.perf_counter()
            read()
            seconds.append(time.perf_counter() - start)
        figures[name] = {"best_gb_s": size / min(seconds) / 1e9, "median_gb_s": size / statistics.median(seconds) / 1e9}
    return figures


def kernel_times(path: pathlib.Path, threads: int, calls: int = 20) -> dict:
    """Per layout of `path`'s linears and logits: tensors, resident bytes and seconds of one decode row through each (medians summed)."""
    import torch

    from corral.gguf import GGUFFile
    from corral.registry import Plugins

    torch.set_num_threads(threads)
    plugins = Plugins()
    gguf = GGUFFile.open(path)
    backend = plugins.open_backend()
    weights = [
        (
            f"{info.qtype.name} {role} -> {backend.layout(info, role)}",
            backend.load_tensor(gguf, info, role),
            torch.randn(1, info.shape[-1]),
            backend.resident_bytes([(info, role)]),
        )
        for info, role in plugins.architecture_for(gguf).tensor_plan(gguf)
        if role in ("linear", "logits")
    ]
    # One pass calls every weight once, as a decode step does: the weights come from memory, not from cache.
    passes = []
    for _ in range(calls + 1):
        seconds = collections.Counter()
        for key, weight, x, _ in weights:
            start = time.perf_counter()
            weight.matmul(x, None)
            seconds[key] += time.perf_counter() - start
        passes.append(seconds)
    layouts = {}
    for key in dict.fromkeys(key for key, *_ in weights):
        layouts[key] = {
            "tensors": sum(1 for k, *_ in weights if k == key),
            "bytes": sum(size for k, _, _, size in weights if k == key),
            "seconds": statistics.median(p[key] for p in passes[1:]),  # the first pass warms up
        }
    return layouts


def print_kernels(files: list[pathlib.Path], thread_counts: list[int]) -> None:
    print("\n| file | threads | ms a token in the linears and logits | per layout: ms, GB/s of its resident bytes |")
    print("|---|---|---|---|")
    for path in files:
        for threads in thread_counts:
            layouts = kernel_times(path, threads)
            total = sum(entry["seconds"] for entry in layouts.values())
            parts = ", ".join(
                f"{key} x{e['tensors']}: {1e3 * e['seconds']:.1f} ms, {e['bytes'] / e['seconds'] / 1e9:.1f} GB/s"
                for key, e in layouts.items()
            )
            print(f"| {path.name} | {threads} | {1e3 * total:.1f} | {parts} |", flush=True)


def load_average() -> float:
    return os.getloadavg()[0]


def run_corral(path: pathlib.Path, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    command = [
        sys.executable,
        "-c",
        "from corral.cli import main; main()",
        "bench",
        str(path),
        "--prompt-tokens",
        str(prompt_tokens),
        "--gen-tokens",
        str(gen_tokens),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        raise SystemExit(f"corral bench failed on {path}:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout[done.stdout.index("{") :])
    return {"prefill_tok_s": figures["prefill_tok_s"], "decode_tok_s": figures["decode_tok_s"], "load_s": figures["load_s"]}


def run_llama_bench(binary: pathlib.Path, path: pathlib.Path, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    command = [str(binary), "-m", str(path), "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens), "-r", "3", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-bench failed on {path}:\n{done.stderr[-3000:]}")
    figures = {}
    for test in json.loads(done.stdout):
        figures["prefill_tok_s" if test["n_prompt"] else "decode_tok_s"] = test["avg_ts"]
    return figures


def measure(files: list[pathlib.Path], args) -> list[dict]:
    """Every file through both engines per round, alternating which goes first; one record per run."""
    records = []
    for round_index in range(args.rounds):
        engines = ["corral", "llama.cpp"] if round_index % 2 == 0 else ["llama.cpp", "corral"]
        for path in files:
            for threads in args.threads:
                for engine in engines:
                    load = load_average()
                    if engine == "corral":
                        figures = run_corral(path, args.prompt_tokens, args.gen_tokens, threads)
                    else:
                        figures = run_llama_bench(args.bin / "llama-bench", path, args.prompt_tokens, args.gen_tokens, threads)
                    record = {
                        "round": round_index + 1,
                        "file": path.name,
                        "threads": threads,
                        "engine": engine,
                        "load_before": load,
                        **figures,
                    }
                    print(json.dumps(record), flush=True)
                    records.append(record)
    return records


def print_tables(files: list[pathlib.Path], mixes: dict, bandwidth: dict, records: list[dict], thread_counts: list[int]) -> None:
    print(f"\nread bandwidth: {json.dumps(bandwidth)}\n")
    print("| file | tensors by type (count: M weights) | bits/weight in the file | resident in corral | corral's layouts |")
    print("|---|---|---|---|---|")
    for path in files:
        mix = mixes[path.name]
        types = ", ".join(
            f"{name} {count}: {weights / 1e6:.1f}" for name, (count, weights) in sorted(mix["types"].items(), key=lambda t: -t[1][1])
        )
        layouts = ", ".join(f"{key} x{count}" for key, count in mix["corral_layouts"].items())
        print(f"| {path.name} | {types} | {mix['file_bits_per_weight']:.2f} | {mix['corral_bits_per_weight']:.2f} | {layouts} |")

    for threads in thread_counts:
        gb_s = bandwidth["1 thread" if threads == 1 else "2 threads"]["best_gb_s"]
        chosen = [r for r in records if r["threads"] == threads]

        def cells(name: str, engine: str, key: str) -> str:
            values = [r[key] for r in chosen if r["file"] == name and r["engine"] == engine]
            return " / ".join(f"{v:.1f}" for v in values) + (f" (median {statistics.median(values):.1f})" if len(values) > 2 else "")

        print(f"\n{threads} thread(s); floors at {gb_s:.1f} GB/s (tok/s, and the bytes read a token)\n")
        print(
            "| file | corral decode tok/s | floor | llama.cpp decode tok/s | floor | corral prefill tok/s | llama.cpp prefill tok/s | load average before each run |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for path in files:
            mix, name = mixes[path.name], path.name
            loads = " / ".join(f"{r['load_before']:.1f}" for r in chosen if r["file"] == name)
            print(
                f"| {name} | {cells(name, 'corral', 'decode_tok_s')} | {gb_s * 1e9 / mix['corral_bytes_per_token']:.0f} "
                f"({mix['corral_bytes_per_token'] / 1e6:.0f} MB) | {cells(name, 'llama.cpp', 'decode_tok_s')} | "
                f"{gb_s * 1e9 / mix['llama_cpp_bytes_per_token']:.0f} ({mix['llama_cpp_bytes_per_token'] / 1e6:.0f} MB) | "
                f"{cells(name, 'corral', 'prefill_tok_s')} | {cells(name, 'llama.cpp', 'prefill_tok_s')} | {loads} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", action="store_true", help="build the files first")
    parser.add_argument("--source", help="the model to quantize from (default: the store's smollm2)")
    parser.add_argument("--stem", default="smollm2")
    parser.add_argument("--dir", type=pathlib.Path, default=PEERS / "quant")
    parser.add_argument("--bin", type=pathlib.Path, default=PEERS / "build" / "bin", help="llama.cpp's built tools")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="thread counts, each run in every round")
    parser.add_argument("--types", nargs="+", default=["F32"] + [name for name, _, _ in TYPES])
    parser.add_argument("--json", type=pathlib.Path, help="write every figure here")
    parser.add_argument("--kernels", action="store_true", help="also time one decode row through each file's linears")
    args = parser.parse_args()
    if args.make:
        from corral.store import ensure_model

        make_files(args.bin / "llama-quantize", pathlib.Path(args.source or ensure_model("smollm2")), args.dir, args.stem)
    files = [args.dir / f"{args.stem}-{name}.gguf" for name in args.types]
    mixes = {path.name: type_mix(path) for path in files}
    bandwidth = read_bandwidth()
    print(f"read bandwidth (load average {load_average():.1f}): {json.dumps(bandwidth)}", flush=True)
    records = measure(files, args) if args.rounds else []
    print_tables(files, mixes, bandwidth, records, args.threads)
    if args.kernels:
        print_kernels(files, args.threads)
    if args.json:
        args.json.write_text(json.dumps({"mixes": mixes, "bandwidth": bandwidth, "records": records}, indent=1))


if __name__ == "__main__":
    main()
