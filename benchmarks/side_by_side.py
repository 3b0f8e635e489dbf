"""corral and llama.cpp on the same GGUF files, measured in one run, alternating.

    pip install llama-cpp-python        # builds llama.cpp from source (~12 min on 2 cores)
    python benchmarks/side_by_side.py [--models smollm2 gemma3:270m] [--rounds 2] [--threads 2]

Every measurement runs in a fresh process (so resident memory is the model's, not the previous
one's), and the two engines alternate round by round so machine noise hits both alike. Prints a
table per model with each figure, both engines and the ratio (corral / llama.cpp; for memory and
load time lower is better).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LLAMA_CPP = r'''
import json, resource, sys, time
from llama_cpp import Llama

path, prompt_tokens, gen_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
llm = Llama(model_path=path, n_ctx=prompt_tokens + gen_tokens + 16, n_batch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False)
load_s = time.perf_counter() - start
with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * resource.getpagesize() / 1e6
text = "The history of astronomy spans thousands of years, from the first people who tracked the moon "
ids = []
while len(ids) < prompt_tokens:
    ids += llm.tokenize(text.encode(), add_bos=False)
ids = ids[:prompt_tokens]
llm.eval(ids[:8]); llm.reset()  # warm up
start = time.perf_counter()
llm.eval(ids)
prefill_s = time.perf_counter() - start
start = time.perf_counter()
for _ in range(gen_tokens):
    token = llm.sample(temp=0.0)  # greedy on the last logits
    llm.eval([token])
decode_s = time.perf_counter() - start
print(json.dumps({"load_s": load_s, "prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": gen_tokens / decode_s,
                  "rss_after_load_mb": rss, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}))
'''

FIGURES = [
    ("load_s", "load time (s)", "lower"),
    ("prefill_tok_s", "prefill tok/s", "higher"),
    ("decode_tok_s", "decode tok/s (batch 1)", "higher"),
    ("rss_after_load_mb", "RSS after load (MB)", "lower"),
    ("peak_rss_mb", "peak RSS (MB)", "lower"),
]


def run_corral(model: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    command = [sys.executable, "-c", (
        "import json, torch; torch.set_num_threads(%d); from corral.bench import run_bench; "
        "print(json.dumps(run_bench(%r, prompt_tokens=%d, gen_tokens=%d)))" % (threads, model, prompt_tokens, gen_tokens)
    )]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def run_llama_cpp(path: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    command = [sys.executable, "-c", LLAMA_CPP, path, str(prompt_tokens), str(gen_tokens), str(threads)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3:270m"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from corral import store

    for model in args.models:
        path = str(store.ensure_model(model))
        results: dict[str, list[dict]] = {"corral": [], "llama.cpp": []}
        for _ in range(args.rounds):
            results["corral"].append(run_corral(model, args.prompt_tokens, args.gen_tokens, args.threads))
            results["llama.cpp"].append(run_llama_cpp(path, args.prompt_tokens, args.gen_tokens, args.threads))
        print(f"\n## {model} ({args.rounds} rounds, median; {args.threads} threads)\n")
        print("| figure | corral | llama.cpp | corral / llama.cpp |")
        print("|---|---|---|---|")
        for key, label, _better in FIGURES:
            ours = statistics.median(r[key] for r in results["corral"])
            theirs = statistics.median(r[key] for r in results["llama.cpp"])
            print(f"| {label} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
