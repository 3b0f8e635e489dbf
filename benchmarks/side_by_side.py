"""corral against llama.cpp's own C++ tools on the same GGUF files, in one run, alternating.

    python benchmarks/side_by_side.py [--models smollm2 gemma3:270m] [--rounds 3] [--threads 2] [--streams 8]
        [--python-binding] [--json results.json] [--llama-cpp-no-amx]

In every round, for each model, both engines run each test in fresh processes, which engine goes
first alternating from round to round so a shared machine's drift hits both alike:

* batch 1: `corral bench`'s measurement (512-token prefill in one batch, then 128 greedy tokens,
  and 128 more from an empty context) against `llama-bench -t T -p 512 -n 128 -d 0,512 -r 1`
  (its `tg` decodes from an empty context; `-d 512` decodes after 512 tokens, as corral's main
  figure does);
* serving: N concurrent greedy HTTP streams (`--streams`, 64-token prompts, exactly 64 tokens each
  with `ignore_eos`) against `corral serve` (CORRAL_NUM_PARALLEL=N) and against
  `llama-server -np N` (the same prompts, as text, and the same per-slot context), after one
  warm-up request; generated tokens / wall time, time to first token, per-stream decode rate.

llama-bench and llama-server are built from the llama-cpp-python sdist when missing
(llama_cpp_tools.py; `--llama-cpp-no-amx` builds and runs them without ggml's AMX code, which
crashed on an Intel VM). Beside each decode figure is its bandwidth ceiling: the machine's read
bandwidth (quant_types.read_bandwidth, measured here first, or --bandwidth) over the bytes an engine reads a
token: corral's resident weight bytes (its embedding read a row a token), llama.cpp's file tensor
bytes (the embedding counted only when it is the output matrix too), plus the KV cache at that
context. Prefill is compute-bound: no bandwidth ceiling. The tables print as markdown, medians of
the rounds with their range, the load average before each run beneath.

`--python-binding` adds the older comparison through llama-cpp-python (llama_cpp_python.py) as a
second table, when the binding is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import http_streams  # noqa: E402 - benchmarks/ is not a package
import llama_cpp_tools  # noqa: E402
from quant_types import read_bandwidth, type_mix  # noqa: E402


def run_json(command: list[str], env: dict | None = None) -> dict:
    """Run `command` in a fresh process; its last line of output is a JSON object."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def corral_batch1(model: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    code = (
        "import json, torch; torch.set_num_threads(%d); from corral.bench import run_bench; "
        "print(json.dumps(run_bench(%r, prompt_tokens=%d, gen_tokens=%d, from_empty=True)))" % (threads, model, prompt_tokens, gen_tokens)
    )
    figures = run_json([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return {
        "prefill_tok_s": figures["prefill_tok_s"],
        "decode_tok_s": figures["decode_tok_s_from_empty"],
        f"decode_tok_s_at_{prompt_tokens}": figures["decode_tok_s"],
        "load_s": figures["load_s"],
        "rss_after_load_mb": figures["rss_after_load_mb"],
    }


def llama_cpp_batch1(path: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    return llama_cpp_tools.llama_bench(path, threads, prompt_tokens, gen_tokens, depths=(0, prompt_tokens))


def serve_streams(engine: str, model: str, path: str, prompts: list[str], gen_tokens: int, slot_context: int, threads: int) -> dict:
    """The prompts as concurrent streams against a fresh server of `engine`, after one warm-up request."""
    if engine == "corral":
        server = http_streams.CorralServer(len(prompts), slot_context, threads)
        request, parse = (lambda p, n: http_streams.corral_request(model, p, n)), http_streams.corral_events
    else:
        server = llama_cpp_tools.LlamaServer(path, len(prompts), slot_context, threads)
        request, parse = http_streams.llama_server_request, http_streams.llama_server_events
    with server:
        http_streams.warm_up(server.base_url, request("Warm up: " + prompts[0], 4), parse)
        return http_streams.run_streams(server.base_url, [request(p, gen_tokens) for p in prompts], parse)


def kv_bytes_per_cell(path: str, kv_itemsize: int = 2) -> int:
    """Bytes of keys and values one context cell holds over all layers (both engines keep 16-bit caches)."""
    from corral.gguf import GGUFFile

    gguf = GGUFFile.open(path)
    rows = sum(info.shape[0] for name, info in gguf.tensors.items() if name.endswith((".attn_k.weight", ".attn_v.weight")))
    return rows * kv_itemsize


def ceilings(path: str, gb_s: float, args: argparse.Namespace) -> dict:
    """Bandwidth ceilings (tok/s) of each engine's decode figures on `path`."""
    mix, cell = type_mix(pathlib.Path(path)), kv_bytes_per_cell(path)
    weights = {"corral": mix["corral_bytes_per_token"], "llama.cpp": mix["llama_cpp_bytes_per_token"]}
    stream_depth = args.stream_prompt_tokens + args.stream_gen_tokens // 2  # the middle of the streams' decode
    out = {}
    for engine, weight_bytes in weights.items():
        out[engine] = {
            "bytes_per_token": weight_bytes,
            "decode_tok_s": gb_s * 1e9 / (weight_bytes + cell * args.gen_tokens // 2),
            f"decode_tok_s_at_{args.prompt_tokens}": gb_s * 1e9 / (weight_bytes + cell * (args.prompt_tokens + args.gen_tokens // 2)),
            "aggregate_tok_s": args.streams * gb_s * 1e9 / (weight_bytes + args.streams * cell * stream_depth),
        }
        out[engine]["stream_tok_s"] = out[engine]["aggregate_tok_s"] / args.streams
    return out


def measure(model: str, path: str, args: argparse.Namespace) -> list[dict]:
    """Every round's figures of both engines on one model; one record per engine and round."""
    from corral.tokenizer import load_tokenizer

    prompts = http_streams.stream_prompts(load_tokenizer(path), args.streams, args.stream_prompt_tokens)
    slot_context = args.stream_prompt_tokens + args.stream_gen_tokens + 64
    records = []
    for round_index in range(args.rounds):
        engines = ["corral", "llama.cpp"] if round_index % 2 == 0 else ["llama.cpp", "corral"]
        for engine in engines:
            record = {"model": model, "round": round_index + 1, "engine": engine, "load_before": os.getloadavg()[0]}
            if engine == "corral":
                record.update(corral_batch1(model, args.prompt_tokens, args.gen_tokens, args.threads))
            else:
                record.update(llama_cpp_batch1(path, args.prompt_tokens, args.gen_tokens, args.threads))
            streams = serve_streams(engine, model, path, prompts, args.stream_gen_tokens, slot_context, args.threads)
            if streams["generated_tokens"] != args.streams * args.stream_gen_tokens:
                print(f"warning: {model}: {engine}'s streams generated {streams['generated_tokens']} tokens, not "
                      f"{args.streams * args.stream_gen_tokens}", file=sys.stderr)
            record.update({key: streams[key] for key in ("aggregate_tok_s", "ttft_ms", "stream_tok_s", "prompt_tokens")})
            print(json.dumps(record), file=sys.stderr, flush=True)
            records.append(record)
    return records


def cell(records: list[dict], engine: str, key: str, digits: int) -> tuple[str, float | None]:
    """'median (min-max)' of one figure over the rounds, and the median."""
    values = [r[key] for r in records if r["engine"] == engine and key in r]
    if not values:
        return "—", None
    median = statistics.median(values)
    spread = f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else ""
    return f"{median:.{digits}f}{spread}", median


def print_table(model: str, records: list[dict], limits: dict, args: argparse.Namespace) -> None:
    p, g, n = args.prompt_tokens, args.gen_tokens, args.streams
    rows = [
        ("decode tok/s, batch 1, from an empty context", f"llama-bench tg{g}", "decode_tok_s", 1, True),
        (f"decode tok/s, batch 1, after {p} tokens", f"llama-bench tg{g} -d {p}", f"decode_tok_s_at_{p}", 1, True),
        (f"prefill tok/s, {p} tokens", f"llama-bench pp{p}", "prefill_tok_s", 0, True),
        (f"aggregate tok/s, {n} HTTP streams", f"llama-server -np {n}", "aggregate_tok_s", 1, True),
        (f"time to first token, {n} streams (ms)", f"llama-server -np {n}", "ttft_ms", 0, False),
        (f"per-stream decode tok/s, {n} streams", f"llama-server -np {n}", "stream_tok_s", 1, True),
    ]
    loads = " / ".join(f"{r['engine']} {r['load_before']:.1f}" for r in records)
    print(f"\n### {model}: {args.rounds} round(s), {args.threads} threads\n")
    print("| figure | corral | llama.cpp | tool | corral / llama.cpp | bandwidth ceiling, corral / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for label, tool, key, digits, higher in rows:
        ours, our_median = cell(records, "corral", key, digits)
        theirs, their_median = cell(records, "llama.cpp", key, digits)
        ratio = f"{our_median / their_median:.2f}x" if our_median and their_median else "—"
        if not higher and our_median and their_median:
            ratio += " (lower is better)"
        if key in limits["corral"]:
            limit = f"{limits['corral'][key]:.0f} / {limits['llama.cpp'][key]:.0f}"
        else:
            limit = "— (compute-bound)" if key == "prefill_tok_s" else "—"
        print(f"| {label} | {ours} | {theirs} | {tool} | {ratio} | {limit} |")
    ours, _ = cell(records, "corral", "prompt_tokens", 0)
    theirs, _ = cell(records, "llama.cpp", "prompt_tokens", 0)
    print(f"\nPrompt tokens a stream as each server counted them: corral {ours}, llama-server {theirs}. corral load "
          f"{cell(records, 'corral', 'load_s', 2)[0]} s, RSS after load {cell(records, 'corral', 'rss_after_load_mb', 0)[0]} MB. "
          f"Bytes a decode token reads: corral {limits['corral']['bytes_per_token'] / 1e6:.0f} MB, llama.cpp "
          f"{limits['llama.cpp']['bytes_per_token'] / 1e6:.0f} MB (+ the KV cache). Load average before each run: {loads}.")


def python_binding_table(model: str, path: str, args: argparse.Namespace) -> None:
    """The older comparison through llama-cpp-python: batch 1 and N streams through its C API, no HTTP."""
    import llama_cpp_python

    code = (
        "import json, torch; torch.set_num_threads(%d); from corral.bench import run_concurrency_bench; "
        "print(json.dumps(run_concurrency_bench(%r, concurrency=%d, prompt_tokens=%d, gen_tokens=%d)))"
        % (args.threads, model, args.streams, args.stream_prompt_tokens, args.stream_gen_tokens)
    )
    ours = run_json([sys.executable, "-c", code])
    theirs = llama_cpp_python.run_llama_cpp_streams(path, args.streams, args.stream_prompt_tokens, args.stream_gen_tokens, args.threads)
    binding = llama_cpp_python.run_llama_cpp(path, args.prompt_tokens, args.gen_tokens, args.threads)
    print(f"\n### {model} through llama-cpp-python (one round)\n")
    print("| figure | corral | llama-cpp-python | corral / llama.cpp |")
    print("|---|---|---|---|")
    print(f"| aggregate tok/s, {args.streams} streams (Trio runtime / C API batching) | {ours['aggregate_tok_s']:.1f} | "
          f"{theirs['aggregate_tok_s']:.1f} | {ours['aggregate_tok_s'] / theirs['aggregate_tok_s']:.2f}x |")
    for key in ("decode_tok_s", "prefill_tok_s", "load_s", "rss_after_load_mb", "peak_rss_mb"):
        print(f"| {key} (binding) | | {binding[key]:.2f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3:270m"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8, help="concurrent greedy HTTP streams")
    parser.add_argument("--stream-prompt-tokens", type=int, default=64)
    parser.add_argument("--stream-gen-tokens", type=int, default=64)
    parser.add_argument("--python-binding", action="store_true", help="also compare through llama-cpp-python")
    parser.add_argument("--bandwidth", type=float, help="GB/s of reads for the ceilings, measured elsewhere (a quiet run) instead of now")
    parser.add_argument("--json", type=pathlib.Path, help="write every record here")
    parser.add_argument("--llama-cpp-no-amx", action="store_true", help="llama.cpp's tools built without AMX (llama_cpp_tools.NO_AMX_FLAGS)")
    args = parser.parse_args()

    from corral import store

    llama_cpp_tools.no_amx = args.llama_cpp_no_amx
    for name in ("llama-bench", "llama-server"):  # built before anything is timed
        llama_cpp_tools.tool(name)
    if args.bandwidth:
        bandwidth, gb_s = {"given_gb_s": args.bandwidth}, args.bandwidth
    else:
        bandwidth = read_bandwidth(passes=5)
        gb_s = bandwidth["2 threads" if args.threads > 1 else "1 thread"]["best_gb_s"]
    print(f"read bandwidth (load average {os.getloadavg()[0]:.1f}): {json.dumps(bandwidth)}", file=sys.stderr, flush=True)
    everything = {"bandwidth": bandwidth, "models": {}}
    for model in args.models:
        path = str(store.ensure_model(model))
        records = measure(model, path, args)
        limits = ceilings(path, gb_s, args)
        print_table(model, records, limits, args)
        everything["models"][model] = {"records": records, "ceilings": limits}
        if args.python_binding:
            python_binding_table(model, path, args)
    how = "given" if args.bandwidth else f"{'2 threads' if args.threads > 1 else '1 thread'}, the best of 5 passes"
    print(f"\nCeilings at {gb_s:.1f} GB/s of reads ({how}).")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
