"""What splitting a model over processes costs on one machine: a model in one process, over N
tensor-parallel ranks and over M pipeline stages (gloo on CPU).

    python benchmarks/parallel.py [--model gemma3:270m] [--tp 2] [--pp 2] [--prompt-tokens 128] [--gen-tokens 64]
        [--rounds 3] [--threads N]

(smollm2's 9 heads split over 3 ranks, not 2: `--model smollm2 --tp 3`.)

Each round prefills one prompt and then decodes batch-1 steps through the model's own forward
(`LoadedModel.compute`, no sampling); the splits alternate round by round, each figure is the best
round. All ranks share this machine's cores (`--threads` per rank; default: the cores divided by
the ranks, as corral does), so on a CPU the figure is the overhead of the split, not a speed-up.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from corral.engine import load_model
from corral.model import Batch


def one_round(model, prompt: list[int], gen_tokens: int) -> tuple[float, float]:
    """(prefill seconds, mean decode-step seconds) of one prompt and `gen_tokens` decode steps."""
    cache = model.new_cache(len(prompt) + gen_tokens + 1)
    start = time.perf_counter()
    model.compute(Batch.single(prompt), cache)
    prefill = time.perf_counter() - start
    token, steps = prompt[-1], []
    for i in range(gen_tokens):
        start = time.perf_counter()
        model.compute(Batch.single([token], start=len(prompt) + i), cache)
        steps.append(time.perf_counter() - start)
    return prefill, float(np.mean(steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3:270m")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    splits = {"one process": {}, f"tensor_parallel {args.tp}": {"tensor_parallel": args.tp}, f"pipeline_parallel {args.pp}": {"pipeline_parallel": args.pp}}
    models = {}
    for name, split in splits.items():
        ranks = max(split.values(), default=1)
        models[name] = load_model(args.model, num_thread=args.threads or max(1, cores // ranks), **split)
    prompt = (models["one process"].tokenize("The history of the printing press begins ") * args.prompt_tokens)[: args.prompt_tokens]
    best: dict[str, tuple[float, float]] = {}
    try:
        for _ in range(args.rounds):
            for name, model in models.items():
                prefill, step = one_round(model, prompt, args.gen_tokens)
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], prefill), min(old[1], step))
    finally:
        for model in models.values():
            model.close()
    base = best["one process"][1]
    print(f"| {args.model}, {cores} cores | prefill {args.prompt_tokens} tok (s) | decode step (ms) | decode tok/s | step vs one process |")
    print("|---|---|---|---|---|")
    for name, (prefill, step) in best.items():
        print(f"| {name} | {prefill:.3f} | {step * 1e3:.1f} | {1 / step:.1f} | {step / base:.2f}x |")


if __name__ == "__main__":
    main()
