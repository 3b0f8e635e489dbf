"""The native int8-row kernel against torch's paths for the same Int8Weight, at smollm2's and gemma3:270m's shapes.

    python benchmarks/int8_rows.py [--rows 1 8 512] [--rounds 7] [--threads 2]
    python benchmarks/int8_rows.py --model gemma3:270m


Per weight shape [out, in] and row count: the median call of up to 200 alternating calls (at least `--rounds`) of
`native.int8_rows_matmul` (what Int8Weight runs where the kernel builds), torch's row kernel
`_weight_int8pack_mm` (bf16 activations: what runs without it) and, at prompt sizes, the float32
matmul of the dequantized weight (the floor a prompt path would have to beat). The vocabulary
projections run at decode sizes only: a prompt computes the logits of its last rows alone.

`--model`: one loaded model's batch-1 decode steps after a 512-token prompt and its 512-token
prefills, alternating blocks with the native int8 kernel off (torch's int8pack, as before the
AVX2 kernel) and on, in one process: the load's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# name -> [out, in]; q/k/v and gate/up fused as the backend stacks them
SHAPES = {
    "smollm2 qkv": (960, 576),
    "smollm2 gate/up": (3072, 576),
    "smollm2 down": (576, 1536),
    "smollm2 vocab": (49152, 576),
    "gemma3 qkv": (1536, 640),
    "gemma3 gate/up": (4096, 640),
    "gemma3 down": (640, 2048),
    "gemma3 vocab": (262144, 640),
}
PROMPT_ROWS = 32  # from here a run is a prompt chunk (layouts.LONG_RUN_ROWS)


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def model_steps(name: str) -> None:
    import numpy as np

    from corral.bench import prompt_ids
    from corral.engine import load_model
    from corral.model import Batch
    from corral.plugins.backends.torch import native

    native_rows = native.takes_int8_rows
    conditions = {"int8pack": lambda codes: False, "native": native_rows}
    model = load_model(name)
    ids = prompt_ids(model, 512)
    cache = model.new_cache(512 + 40 * 8 + 8)
    logits = model.forward(Batch.single(ids), cache)
    position = 512
    decode: dict[str, list[float]] = {key: [] for key in conditions}
    prefill: dict[str, list[float]] = {key: [] for key in conditions}
    for block in range(40):  # blocks of 8 steps, alternating
        key = list(conditions)[block % 2]
        native.takes_int8_rows = conditions[key]
        for _ in range(8):
            start = time.perf_counter()
            logits = model.forward(Batch.single([int(np.argmax(logits[-1]))], start=position), cache)
            decode[key].append(time.perf_counter() - start)
            position += 1
    for rnd in range(4):
        for key in list(conditions)[:: 1 if rnd % 2 == 0 else -1]:
            native.takes_int8_rows = conditions[key]
            fresh = model.new_cache(520)
            prefill[key].append(timed(lambda: model.forward(Batch.single(ids), fresh)))
    native.takes_int8_rows = native_rows
    for key in conditions:
        step = statistics.median(decode[key])
        print(
            f"{name} {key}: decode {step * 1e3:.1f} ms a token ({1 / step:.1f} tok/s; p25 {np.percentile(decode[key], 25) * 1e3:.1f} ms), "
            f"prefill {512 / statistics.median(prefill[key]):.0f} tok/s (median of {len(prefill[key])})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    parser.add_argument("--rounds", type=int, default=7, help="the fewest calls of each path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="time this model's decode steps and prefills instead, the kernel off and on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        model_steps(args.model)
        return

    from corral.plugins.backends.torch import native
    from corral.plugins.backends.torch.layouts import Int8Weight

    print(f"variant {native.variant()}, int8 hardware (VNNI) {native.int8_products_are_fast()}, threads {args.threads}")
    print("| weight | rows | native | torch int8pack | native vs int8pack | dequantized fp32 matmul |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (out, cols) in SHAPES.items():
        weight = Int8Weight(torch.randint(-127, 128, (out, cols), dtype=torch.int8, generator=gen), (torch.rand(out, generator=gen) / 100).bfloat16())
        if not native.takes_int8_rows(weight.codes):
            print(f"| {name} {out}x{cols} | - | the native kernel does not take it here | | | |")
            continue
        dense = weight.dequantized() if out * cols <= 1 << 24 else None
        for rows in args.rows:
            if rows >= PROMPT_ROWS and "vocab" in name:
                continue
            x = torch.randn(rows, cols, generator=gen)
            xb = x.bfloat16()
            calls = max(args.rounds, min(200, int(3e9 // (out * cols * rows))))
            paths = {
                "native": lambda: native.int8_rows_matmul(x, weight.codes, weight.scales),
                "int8pack": lambda: torch._weight_int8pack_mm(xb, weight.codes, weight.scales),
            }
            if dense is not None and rows >= PROMPT_ROWS:
                paths["dense"] = lambda: x @ dense.T
            times: dict[str, list[float]] = {key: [] for key in paths}
            for call in paths.values():
                call()  # warm: pages touched, threads started
            for _ in range(calls):  # alternating, each call timed alone: a preempted call moves a median little
                for key, call in paths.items():
                    times[key].append(timed(call))
            med = {key: statistics.median(values) * 1e3 for key, values in times.items()}
            dense_ms = f"{med['dense']:.2f} ms" if "dense" in med else ""
            print(
                f"| {name} {out}x{cols} | {rows} | {med['native']:.3f} ms | {med['int8pack']:.3f} ms | "
                f"{med['int8pack'] / med['native']:.1f}x | {dense_ms} |",
                flush=True,
            )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
