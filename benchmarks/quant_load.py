"""Convert every tensor of a GGUF file the way the torch backend loads it, and print the figures.

    python benchmarks/quant_load.py MODEL.gguf [--threads 2] [--passes 5]

Q4_0/Q4_1/Q4_K tensors are packed for torch's CPU int4 kernel; everything else is dequantized to
bfloat16. Prints seconds per GGML type and overall, then the error that bf16 scales_and_zeros add
to the int4 matmul, against x @ W.T with W dequantized exactly in float32.
"""

from __future__ import annotations

import argparse
import collections
import math
import time
import warnings

import gguf
import numpy as np
import torch

from corral.plugins.backends.torch import dequantize as torch_quant, int4_packing

INT4 = set(torch_quant.INT4_CODERS)


def raw_tensors(path: str) -> list[tuple[str, gguf.GGMLQuantizationType, int, torch.Tensor]]:
    """(name, type, cols, raw uint8 [rows, row_bytes]) over the file's memory map."""
    reader = gguf.GGUFReader(path)
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the memory map is read-only; nothing here writes to it
        for t in reader.tensors:
            cols = int(t.shape[0])
            rows = math.prod(int(n) for n in t.shape[1:])
            raw = torch.frombuffer(np.asarray(t.data).view(np.uint8), dtype=torch.uint8).reshape(rows, -1)
            tensors.append((t.name, t.tensor_type, cols, raw))
    return tensors


def load(qtype: gguf.GGMLQuantizationType, cols: int, raw: torch.Tensor) -> object:
    if qtype in INT4 and raw.shape[0] % 16 == 0:
        return int4_packing.pack_int4_for_cpu(*torch_quant.int4_codes(raw, qtype, cols))
    return torch_quant.dequantize(raw, qtype, cols, torch.bfloat16)


def time_load(tensors) -> dict[str, tuple[int, int, float]]:
    """One pass over every tensor: {'Q4_1 (int4)': (tensors, params, seconds), ...}."""
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    params: collections.Counter[str] = collections.Counter()
    for _, qtype, cols, raw in tensors:
        key = qtype.name + (" (int4)" if qtype in INT4 and raw.shape[0] % 16 == 0 else " (bf16)")
        start = time.perf_counter()
        load(qtype, cols, raw)
        seconds[key] += time.perf_counter() - start
        counts[key] += 1
        params[key] += raw.shape[0] * cols
    return {key: (counts[key], params[key], seconds[key]) for key in seconds}


def print_times(title: str, figures: dict[str, tuple[int, int, float]]) -> None:
    print(title)
    for key, (count, params, seconds) in sorted(figures.items(), key=lambda item: -item[1][2]):
        rate = params / seconds / 1e6
        print(f"  {key:14s} {count:4d} tensors {params / 1e6:8.1f} M params {seconds:7.3f} s  {rate:7.0f} M/s")
    count, params, seconds = (sum(column) for column in zip(*figures.values()))
    print(f"  {'total':14s} {count:4d} tensors {params / 1e6:8.1f} M params {seconds:7.3f} s")


def int4_errors(tensors, batch: int = 8) -> None:
    """Worst error over the file's int4 tensors of each way to multiply, against x @ W.T in float32."""
    torch.manual_seed(0)
    worst: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])

    def record(qtype, label, max_rel, rms_rel):
        entry = worst[(qtype.name, label)]
        entry[0], entry[1] = max(entry[0], max_rel), max(entry[1], rms_rel)

    for _, qtype, cols, raw in tensors:
        if qtype not in INT4 or raw.shape[0] % 16:
            continue
        w = torch_quant.dequantize(raw, qtype, cols)
        codes, scales, zeros = torch_quant.int4_codes(raw, qtype, cols)
        x = torch.randn(batch, cols).to(torch.bfloat16)
        ref = x.float() @ w.T

        def compare(label, y):
            err = y.float() - ref
            record(qtype, label, (err.abs().max() / ref.abs().max()).item(), (err.norm() / ref.norm()).item())

        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            packed, sz = int4_packing.pack_int4_for_cpu(codes, scales, zeros, dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, sz)
            compare(f"int4 kernel, x and sz {str(dtype)[6:]}", y)
        compare("dense bf16 W (baseline)", x @ w.to(torch.bfloat16).T)

        # The weights the bf16 kernel multiplies, against exact W, in units of each group's step.
        s16, z16 = scales.to(torch.bfloat16).float(), zeros.to(torch.bfloat16).float()
        w_int4 = (codes.float() - 8) * s16.repeat_interleave(32, 1) + z16.repeat_interleave(32, 1)
        step = scales.abs().repeat_interleave(32, 1).clamp_min(torch.finfo(torch.float32).tiny)
        w_bf16 = w.to(torch.bfloat16).float()
        for label, approx in (("weights: int4 + bf16 sz", w_int4), ("weights: dense bf16", w_bf16)):
            dw = (approx - w).abs() / step
            record(qtype, label, dw.max().item(), dw.square().mean().sqrt().item())

    print(f"  {'type':5s} {'computation':32s} {'max':>9s} {'rms':>9s}")
    for (name, label), (max_rel, rms_rel) in worst.items():
        print(f"  {name:5s} {label:32s} {max_rel:9.2e} {rms_rel:9.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    tensors = raw_tensors(args.path)
    print(f"{args.path}: {len(tensors)} tensors, GGUFReader {time.perf_counter() - start:.2f} s (not counted)")
    passes = [time_load(tensors) for _ in range(args.passes)]
    print_times(f"conversion, {args.threads} threads, first pass:", passes[0])
    best = min(passes, key=lambda figures: sum(seconds for _, _, seconds in figures.values()))
    print_times(f"fastest of {args.passes} passes:", best)
    print("int4 error, worst tensor; matmuls: |y - x @ W.T| relative to max |y| and rms |y|;")
    print("weights: |W' - W| in quantization steps (the group's scale):")
    int4_errors(tensors)


if __name__ == "__main__":
    main()
