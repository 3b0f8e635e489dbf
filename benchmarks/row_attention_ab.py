"""Batch-1 decode with the native row_attention kernel against the same model with attention through SDPA.

    python benchmarks/row_attention_ab.py [--models smollm2 gemma3:270m] [--context 64 512] [--rounds 3] [--threads 2]

For each model and context: load, prefill `--context` tokens, decode 3 steps (recording the graph), then
time 30 greedy steps; the kernel on and off alternate for `--rounds` rounds, each a fresh load (the
backend decides a graph's attention path when it records it). Prints the median milliseconds a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from corral.bench import prompt_ids
from corral.engine import load_model
from corral.model import Batch
from corral.plugins.backends.torch import native

STEPS = 30


def step_ms(name: str, context: int, kernel: bool) -> float:
    """Wall milliseconds a batch-1 decode step, after `context` prompt tokens, with or without the kernel."""
    takes = native.takes_row_attention
    native.takes_row_attention = takes if kernel else (lambda *args: False)
    try:
        model = load_model(name)
        cache = model.new_cache(context + STEPS + 8)
        logits = model.forward(Batch.single(prompt_ids(model, context)), cache)
        position = context
        for i in range(STEPS + 3):
            if i == 3:
                start = time.perf_counter()
            logits = model.forward(Batch.single([int(np.argmax(logits[-1]))], start=position), cache)
            position += 1
        return 1e3 * (time.perf_counter() - start) / STEPS
    finally:
        native.takes_row_attention = takes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3:270m"])
    parser.add_argument("--context", nargs="+", type=int, default=[64, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | context | row_attention ms a step | SDPA ms a step | speed-up |\n|---|---|---|---|---|")
    for name in args.models:
        for context in args.context:
            on, off = [], []
            for _ in range(args.rounds):
                on.append(step_ms(name, context, True))
                off.append(step_ms(name, context, False))
            a, b = statistics.median(on), statistics.median(off)
            print(f"| {name} | {context} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
