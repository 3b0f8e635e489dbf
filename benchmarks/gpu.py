"""CUDA correctness against the CPU path, and prefill/decode speed on CUDA: one short prepared run.

    python benchmarks/gpu.py                          # on a CUDA machine (a few minutes for both models)
    python benchmarks/gpu.py --device cpu --quick     # dry run of every section on a CPU-only machine

Per model (store names "smollm2" and "gemma3:270m", already pulled, or GGUF paths via --models):

* correctness: full-prompt logits of CUDA fp32 and CUDA auto against CPU fp32 (the reference):
  max abs difference relative to max |logit|, and argmax agreement at positions where the
  reference's top-1/top-2 margin exceeds 1.0. FAIL unless the CUDA fp32 relative difference is
  < 1e-3 and agreement is 100% for both. Also 16 greedy tokens through the cache, CUDA auto vs CPU
  auto (informational: bf16 rounding may legitimately diverge).
* speed (CUDA, precision auto): load time, 512-token prefill, batch-1 greedy decode of 128 tokens,
  and 32 sequences decoded together in one cache (64 steps of a 32-row batch), peak CUDA memory.

Each section is guarded: a crash prints its traceback and the run goes on. The last line printed
is a JSON object of every figure, also written to --out. Exit status 1 if any check failed or any
section crashed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import numpy as np
import torch

from corral.bench import peak_rss_mb, prompt_ids
from corral.engine import load_model
from corral.kvcache import CausalCache
from corral.model import Batch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
FULL = dict(prefill=512, decode=128, batch=32, batch_prompt=32, batch_steps=64, greedy=16)
QUICK = dict(prefill=64, decode=8, batch=4, batch_prompt=16, batch_steps=8, greedy=8)
MARGIN = 1.0  # reference top-1 minus top-2 logit above which an argmax must agree
FP32_REL_LIMIT = 1e-3

problems: list[str] = []  # failed checks and crashed sections; any makes the exit status 1


def guarded(name: str, fn, *args):
    """Run one section; on an exception print the traceback, note it, and return None."""
    print(f"\n=== {name}", flush=True)
    try:
        return fn(*args)
    except Exception:
        traceback.print_exc()
        problems.append(f"{name}: crashed")
        print(f"CRASH {name}", flush=True)
        return None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    total_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1))
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    for key, value in info.items():
        print(f"{key}: {value}")
    return info


# --- correctness ------------------------------------------------------------------------------
def compare(reference: list[np.ndarray], other: list[np.ndarray]) -> dict:
    """Max |diff| relative to max |reference logit|, and argmax agreement at clear-margin positions."""
    rel, agree, clear = 0.0, 0, 0
    for ref, got in zip(reference, other):
        rel = max(rel, float(np.abs(got - ref).max() / np.abs(ref).max()))
        top2 = np.sort(ref, axis=-1)[:, -2:]
        mask = top2[:, 1] - top2[:, 0] > MARGIN
        agree += int((got.argmax(-1) == ref.argmax(-1))[mask].sum())
        clear += int(mask.sum())
    return {"max_rel_diff": rel, "argmax_agree": agree / clear if clear else None, "clear_positions": clear}


def greedy(model, ids: list[int], count: int) -> list[int]:
    """`count` greedy tokens after `ids`, one cached forward per token (as core/bench.py)."""
    cache = model.new_cache(len(ids) + count)
    logits = model.forward(Batch.single(ids), cache)
    out = [int(np.argmax(logits[-1]))]
    for i in range(count - 1):
        logits = model.forward(Batch.single([out[-1]], start=len(ids) + i), cache)
        out.append(int(np.argmax(logits[-1])))
    return out


def check(label: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}", flush=True)
    if not ok:
        problems.append(f"{label}: {detail}")


def correctness(name: str, device: str, sizes: dict) -> dict:
    reference_model = load_model(name, device="cpu", precision="fp32")
    prompts = [reference_model.tokenize(p, add_special=True) for p in PROMPTS]
    reference = [reference_model.logits(ids) for ids in prompts]
    del reference_model
    release()
    # Separate guards: the fp32 path has no int4 kernel, so its figures survive a crash of "auto".
    return {
        "fp32_vs_cpu_fp32": guarded(f"{name} {device} fp32 logits", logits_check, name, device, "fp32", prompts, reference),
        "auto_vs_cpu_fp32": guarded(f"{name} {device} auto logits", logits_check, name, device, "auto", prompts, reference),
        "greedy": guarded(f"{name} greedy decode", greedy_check, name, device, prompts[0], sizes["greedy"]),
    }


def logits_check(name: str, device: str, precision: str, prompts: list[list[int]], reference: list[np.ndarray]) -> dict:
    model = load_model(name, device=device, precision=precision)
    result = compare(reference, [model.logits(ids) for ids in prompts])
    del model
    release()
    print(f"{device} {precision} vs cpu fp32: {result}")
    label = f"{name} {device} {precision}"
    if precision == "fp32":
        check(f"{label} logits", result["max_rel_diff"] < FP32_REL_LIMIT,
              f"max rel diff {result['max_rel_diff']:.2e} (limit {FP32_REL_LIMIT:.0e})")
    check(f"{label} argmax", result["argmax_agree"] == 1.0,
          f"agreement {result['argmax_agree']} over {result['clear_positions']} positions with margin > {MARGIN}")
    return result


def greedy_check(name: str, device: str, ids: list[int], count: int) -> dict:
    """Greedy text on `device` (auto) and on CPU (auto); a mismatch is reported, not failed."""
    texts = {}
    for dev in dict.fromkeys((device, "cpu")):  # one load when the device is the CPU
        model = load_model(name, device=dev, precision="auto")
        texts[dev] = model.detokenize(greedy(model, ids, count))
        del model
        release()
    same = texts[device] == texts["cpu"]
    print(f"greedy {device} auto: {texts[device]!r}\ngreedy cpu auto: {texts['cpu']!r}\nmatch: {same}")
    return {"prompt": PROMPTS[0], "device_text": texts[device], "cpu_text": texts["cpu"], "match": same}


# --- speed ------------------------------------------------------------------------------------
def batched_decode(model, device: str, sizes: dict) -> dict:
    """`batch` sequences in one cache: each prefilled alone, then decoded together, one row each per step."""
    n, prompt, steps = sizes["batch"], sizes["batch_prompt"], sizes["batch_steps"]
    region = prompt + steps + 8
    cache = CausalCache(model.backend, model.model.cache_layers(), region * n, num_seqs=n)
    base = prompt_ids(model, prompt + n)
    tokens = []
    start = time.perf_counter()
    for seq in range(n):  # a distinct prompt per sequence: the text shifted by `seq` tokens
        logits = model.compute(Batch.single(base[seq : seq + prompt], seq=seq), cache)
        tokens.append(int(logits[-1].argmax()))
    sync(device)
    prefill_s = time.perf_counter() - start

    def step(position: int) -> list[int]:
        batch = Batch(np.asarray(tokens, dtype=np.int64), np.full(n, position, dtype=np.int64),
                      np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64))
        return model.backend.run(model.model, batch, cache.prepare(batch)).argmax(-1).tolist()

    tokens = step(prompt)  # records the batch-shaped graph; not timed
    start = time.perf_counter()
    for i in range(steps):
        tokens = step(prompt + 1 + i)
    sync(device)
    decode_s = time.perf_counter() - start
    return {"sequences": n, "prompt_tokens": prompt, "steps": steps, "prefill_all_s": prefill_s,
            "aggregate_tok_s": n * steps / decode_s, "step_ms": 1e3 * decode_s / steps}


def speed(name: str, device: str, sizes: dict) -> dict:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = load_model(name, device=device, precision="auto")
    sync(device)
    result = {"load_s": time.perf_counter() - start, "quantization": model.info.quantization}
    prefill, decode = sizes["prefill"], sizes["decode"]
    ids = prompt_ids(model, prefill)

    warm = model.new_cache(prefill + 4)  # warm up: kernels, allocator, graph recording
    logits = model.forward(Batch.single(ids), warm)
    for i in range(3):
        logits = model.forward(Batch.single([int(np.argmax(logits[-1]))], start=prefill + i), warm)

    times = []
    for _ in range(3):
        cache = model.new_cache(prefill + decode)
        sync(device)
        start = time.perf_counter()
        logits = model.forward(Batch.single(ids), cache)
        sync(device)
        times.append(time.perf_counter() - start)
    result.update(prefill_tokens=prefill, prefill_tok_s=prefill / min(times))

    token, position = int(np.argmax(logits[-1])), prefill
    start = time.perf_counter()
    for _ in range(decode):
        logits = model.forward(Batch.single([token], start=position), cache)
        token, position = int(np.argmax(logits[-1])), position + 1
    sync(device)
    result.update(decode_tokens=decode, decode_tok_s=decode / (time.perf_counter() - start))
    print(f"load {result['load_s']:.2f} s, prefill {result['prefill_tok_s']:.0f} tok/s, "
          f"decode {result['decode_tok_s']:.1f} tok/s (batch 1)", flush=True)

    result["batched"] = guarded(f"{name} batched decode", batched_decode, model, device, sizes)
    if result["batched"]:
        b = result["batched"]
        print(f"batch {b['sequences']}: {b['aggregate_tok_s']:.0f} tok/s aggregate, {b['step_ms']:.1f} ms/step")
    if device.startswith("cuda"):
        result["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        result["peak_rss_mb"] = peak_rss_mb()
    del model
    release()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3:270m"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (prefill 64, decode 8, batch 4)")
    parser.add_argument("--out", default="gpu_results.json")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()

    results: dict = {"sizes": sizes, "models": {}}
    results["environment"] = guarded("environment", environment, args.device)
    for name in args.models:
        results["models"][name] = {
            "correctness": guarded(f"{name} correctness", correctness, name, args.device, sizes),
            "speed": guarded(f"{name} speed", speed, name, args.device, sizes),
        }
    results["problems"] = problems
    results["wall_s"] = time.perf_counter() - started

    print(f"\n{len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems))
    line = json.dumps(results, default=float)
    with open(args.out, "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
