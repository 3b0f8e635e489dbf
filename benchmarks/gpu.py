"""CUDA against the CPU reference, and CUDA speed: one prepared run that fits in 10 minutes.

    python benchmarks/gpu.py                                  # on a CUDA machine
    python benchmarks/gpu.py --plan                           # what would run, and nothing else
    python benchmarks/gpu.py --device cpu --quick             # every section at small sizes on a CPU
    python benchmarks/gpu.py --references DIR                 # also the converted transformers models

Sections, in order (`--sections` picks some):

* environment: torch, CUDA, the device.
* conformance: every hand-written architecture of tests/tiny_gguf.py (written into a temporary
  folder; their Q4_0 and Q8_0 linears take the int4 and bf16 paths) and, with --references, every
  converted reference model of tests/reference_models.py (a `convert` output folder): logits of
  the device in fp32 and in auto against CPU fp32 on the same ids. FAIL when fp32 differs by more
  than 1e-3 of the largest logit or auto by more than 5e-2 (a few bf16 roundings).
* correctness, per real model (store names, or GGUF paths via --models): full-prompt logits of the
  device fp32 and auto against CPU fp32 (max difference relative to the largest logit; argmax
  agreement where the reference's top-2 margin exceeds 1.0; FAIL unless fp32 < 1e-3 and agreement
  is 100%), and 16 greedy tokens device auto against CPU auto (informational).
* speed, per real model (auto): load, 512-token prefill, batch-1 decode of 128 tokens, and 1, 8 and
  32 sequences decoded together in one cache; the layouts its weights took (int4 packed, bf16
  dense, ...), the same decode in fp32 (the dense float32 path), peak device memory.
* http, per real model: `corral serve` on the device, 8 and 32 concurrent greedy streams of
  64-token prompts and 64 tokens each (benchmarks/http_streams.py, as side_by_side.py measures).
* tp, per real model, when the machine has more than one CUDA device (`--plan` lists the degrees):
  the model split over 2, 3, ... of them (tensor parallelism, NCCL between the ranks' GPUs) against
  one device: 16 greedy tokens in auto (a mismatch is reported, not failed: the all-reduces sum in
  another order) and batch-1 prefill and decode speed. A degree the model's heads do not divide is
  noted as refused. On one device, or on a CPU, it plans nothing and runs nothing.
* graphs, per real model, last (a failed capture may leave the device unusable): whether the
  recorded decode graph of 1, 8 and 32 rows can be captured as a CUDA graph and replayed, the
  replay's logits against the eager step's and its step time. The backend does not capture graphs
  itself yet; this says whether its graphs are ready to be (CUDA only).

Each section is guarded: a crash prints its traceback and the run goes on; sections starting after
--budget-s seconds are skipped (noted). The run ends with markdown tables ready for BENCHMARKS.md
and one JSON line of every figure (also written to --out). Exit status 1 if any check failed or
any section crashed.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import pathlib
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

SECTIONS = ("environment", "conformance", "correctness", "speed", "http", "tp", "graphs")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
FULL = dict(prefill=512, decode=128, batches=(1, 8, 32), batch_prompt=32, batch_steps=64, greedy=16, fp32_decode=32,
            http_streams=(8, 32), http_prompt=64, http_gen=64, graph_steps=32)
QUICK = dict(prefill=64, decode=8, batches=(1, 4), batch_prompt=16, batch_steps=8, greedy=8, fp32_decode=4,
             http_streams=(2,), http_prompt=16, http_gen=8, graph_steps=4)
MARGIN = 1.0  # reference top-1 minus top-2 logit above which an argmax must agree
FP32_REL_LIMIT = 1e-3
AUTO_REL_LIMIT = 5e-2  # tiny models' auto logits: bf16 activations and weights, int4 kernels
TINY_IDS = [int(t) for t in np.random.default_rng(7).integers(0, 256, 12)]  # within every tiny vocabulary

problems: list[str] = []  # failed checks and crashed sections; any makes the exit status 1


class Budget:
    """Seconds since the start; sections that would start after the limit are skipped."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> bool:
        return time.perf_counter() - self.start < self.seconds


def guarded(name: str, fn, *args, budget: Budget | None = None):
    """Run one section; on an exception print the traceback, note it, and return None."""
    print(f"\n=== {name}", flush=True)
    if budget is not None and not budget.left():
        print(f"SKIP {name}: past the time budget", flush=True)
        problems.append(f"{name}: skipped (time budget)")
        return None
    try:
        return fn(*args)
    except Exception:
        traceback.print_exc()
        problems.append(f"{name}: crashed")
        print(f"CRASH {name}", flush=True)
        return None


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: str) -> dict:
    import torch

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


def check(label: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}", flush=True)
    if not ok:
        problems.append(f"{label}: {detail}")


# --- conformance architectures ------------------------------------------------------------------
def architectures(references: pathlib.Path | None) -> list[str]:
    """Every hand-written tiny architecture (tiny_gguf.WRITERS) and every converted reference model that passes fp32."""
    import importlib.util

    from tiny_gguf import WRITERS

    names = [name for name in WRITERS if name != "gpt2" or importlib.util.find_spec("corral_gpt2") is not None]
    if references is not None:
        from reference_models import SPECS

        names += [f"ref-{s.name}" for s in SPECS if (references / s.name / "model.gguf").is_file() and not s.fails("fp32_logits")]
    return names


def tiny_file(name: str, folder: pathlib.Path, references: pathlib.Path | None) -> tuple[pathlib.Path, list[int]]:
    """The GGUF of one architecture of `architectures` (a hand-written one written into `folder`) and the ids to run."""
    if name.startswith("ref-"):
        from reference_models import SPECS_BY_NAME, ConvertedReferences

        spec, converted = SPECS_BY_NAME[name[len("ref-") :]], ConvertedReferences(references)
        return converted.gguf(spec), converted.logits(spec)[0]
    from tiny_gguf import WRITERS

    return pathlib.Path(WRITERS[name](folder / f"{name}.gguf")), TINY_IDS


def conformance(device: str, names: list[str], references: pathlib.Path | None) -> dict:
    import corral

    results = {}
    with tempfile.TemporaryDirectory(prefix="corral-gpu-") as folder:
        for name in names:
            results[name] = guarded(f"conformance {name}", conformance_one, corral, name, *tiny_file(name, pathlib.Path(folder), references), device)
    return results


def conformance_one(corral, name: str, path: pathlib.Path, ids: list[int], device: str) -> dict:
    reference = corral.load_model(path, device="cpu", precision="fp32").logits(ids)
    scale = float(np.abs(reference).max())
    result = {}
    for precision, limit in (("fp32", FP32_REL_LIMIT), ("auto", AUTO_REL_LIMIT)):
        got = corral.load_model(path, device=device, precision=precision).logits(ids)
        rel = float(np.abs(got - reference).max() / scale)
        result[f"{precision}_rel_diff"] = rel
        check(f"conformance {name} {device} {precision}", bool(np.isfinite(got).all()) and rel < limit, f"max rel diff {rel:.2e} (limit {limit:.0e})")
    release()
    return result


# --- correctness of the real models -------------------------------------------------------------
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
    from corral.model import Batch

    cache = model.new_cache(len(ids) + count)
    logits = model.forward(Batch.single(ids), cache)
    out = [int(np.argmax(logits[-1]))]
    for i in range(count - 1):
        logits = model.forward(Batch.single([out[-1]], start=len(ids) + i), cache)
        out.append(int(np.argmax(logits[-1])))
    return out


def correctness(name: str, device: str, sizes: dict) -> dict:
    from corral.engine import load_model

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
    from corral.engine import load_model

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
    from corral.engine import load_model

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
def decode_batch(model, n: int):
    """A cache of `n` sequences and `step(tokens, position)`: one decode row each through the backend's recorded graph."""
    from corral.kvcache import CausalCache
    from corral.model import Batch

    def make(prompt: int, steps: int):
        cache = CausalCache(model.backend, model.model.cache_layers(), (prompt + steps + 8) * n, num_seqs=n)

        def batch(tokens: list[int], position: int) -> Batch:
            return Batch(np.asarray(tokens, dtype=np.int64), np.full(n, position, dtype=np.int64),
                         np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64))

        return cache, batch

    return make


def prefill_sequences(model, cache, n: int, prompt: int) -> list[int]:
    """Each of `n` sequences prefilled alone with the text shifted by its index; each one's first greedy token."""
    from corral.bench import prompt_ids
    from corral.model import Batch

    base = prompt_ids(model, prompt + n)
    return [int(model.compute(Batch.single(base[seq : seq + prompt], seq=seq), cache)[-1].argmax()) for seq in range(n)]


def batched_decode(model, device: str, n: int, sizes: dict) -> dict:
    """`n` sequences in one cache: each prefilled alone, then decoded together, one row each per step."""
    prompt, steps = sizes["batch_prompt"], sizes["batch_steps"]
    cache, batch = decode_batch(model, n)(prompt, steps)
    start = time.perf_counter()
    tokens = prefill_sequences(model, cache, n, prompt)
    sync(device)
    prefill_s = time.perf_counter() - start

    def step(position: int) -> list[int]:
        b = batch(tokens, position)
        return model.backend.run(model.model, b, cache.prepare(b)).argmax(-1).tolist()

    tokens = step(prompt)  # records the batch-shaped graph; not timed
    start = time.perf_counter()
    for i in range(steps):
        tokens = step(prompt + 1 + i)
    sync(device)
    decode_s = time.perf_counter() - start
    return {"sequences": n, "prompt_tokens": prompt, "steps": steps, "prefill_all_s": prefill_s,
            "aggregate_tok_s": n * steps / decode_s, "step_ms": 1e3 * decode_s / steps}


def batch1(model, device: str, prefill: int, decode: int) -> dict:
    """Best-of-3 prefill of `prefill` tokens, then `decode` greedy tokens at batch 1 (after a warm-up)."""
    from corral.bench import prompt_ids
    from corral.model import Batch

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
    token, position = int(np.argmax(logits[-1])), prefill
    start = time.perf_counter()
    for _ in range(decode):
        logits = model.forward(Batch.single([token], start=position), cache)
        token, position = int(np.argmax(logits[-1])), position + 1
    sync(device)
    return {"prefill_tokens": prefill, "prefill_tok_s": prefill / min(times), "decode_tokens": decode,
            "decode_tok_s": decode / (time.perf_counter() - start)}


def layouts(model) -> dict:
    """How many tensors took each layout on this backend (int4_packed, dense bf16, ...)."""
    plan = type(model.model).tensor_plan(model.gguf)
    return dict(collections.Counter(f"{info.qtype.name} {role} -> {model.backend.layout(info, role)}" for info, role in plan if role != "vector"))


def speed(name: str, device: str, sizes: dict) -> dict:
    import torch

    from corral.bench import peak_rss_mb
    from corral.engine import load_model

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = load_model(name, device=device, precision="auto")
    sync(device)
    result = {"load_s": time.perf_counter() - start, "quantization": model.info.quantization, "layouts": layouts(model)}
    print(f"layouts: {result['layouts']}")
    result.update(batch1(model, device, sizes["prefill"], sizes["decode"]))
    print(f"load {result['load_s']:.2f} s, prefill {result['prefill_tok_s']:.0f} tok/s, "
          f"decode {result['decode_tok_s']:.1f} tok/s (batch 1)", flush=True)
    result["batched"] = {}
    for n in sizes["batches"]:
        b = guarded(f"{name} batched decode x{n}", batched_decode, model, device, n, sizes)
        result["batched"][n] = b
        if b:
            print(f"batch {n}: {b['aggregate_tok_s']:.0f} tok/s aggregate, {b['step_ms']:.2f} ms/step")
    if device.startswith("cuda"):
        result["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        result["peak_rss_mb"] = peak_rss_mb()
    del model
    release()
    result["fp32"] = guarded(f"{name} fp32 decode", fp32_speed, name, device, sizes)
    return result


def fp32_speed(name: str, device: str, sizes: dict) -> dict:
    """The dense float32 path (precision fp32): prefill and batch-1 decode, for comparison with auto."""
    from corral.engine import load_model

    model = load_model(name, device=device, precision="fp32")
    result = batch1(model, device, sizes["prefill"], sizes["fp32_decode"])
    del model
    release()
    print(f"fp32: prefill {result['prefill_tok_s']:.0f} tok/s, decode {result['decode_tok_s']:.1f} tok/s")
    return result


# --- HTTP serving -----------------------------------------------------------------------------
def http(name: str, sizes: dict) -> dict:
    """`corral serve` (its default device: CUDA when present) with concurrent streams."""
    import http_streams

    from corral.engine import resolve_model_path
    from corral.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(name))
    results = {}
    for n in sizes["http_streams"]:
        prompts = http_streams.stream_prompts(tokenizer, n, sizes["http_prompt"])
        with http_streams.CorralServer(n, sizes["http_prompt"] + sizes["http_gen"] + 64) as server:
            requests = [http_streams.corral_request(name, p, sizes["http_gen"]) for p in prompts]
            http_streams.warm_up(server.base_url, http_streams.corral_request(name, "Warm up: " + prompts[0], 4), http_streams.corral_events)
            results[n] = http_streams.run_streams(server.base_url, requests, http_streams.corral_events)
        r = results[n]
        print(f"{n} HTTP streams: {r['aggregate_tok_s']:.0f} tok/s aggregate, first token {r['ttft_ms']:.0f} ms, "
              f"{r['stream_tok_s']:.1f} tok/s a stream, {r['generated_tokens']} tokens", flush=True)
        check(f"{name} {n} HTTP streams", r["generated_tokens"] == n * sizes["http_gen"], f"{r['generated_tokens']} tokens generated")
    return results


# --- tensor parallelism over CUDA devices -------------------------------------------------------
def tp_degrees(device: str) -> list[int]:
    """The tensor-parallel degrees to run: 2 up to the number of CUDA devices (none on a CPU or on one device)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return []
    return list(range(2, torch.cuda.device_count() + 1))


def tensor_parallel(name: str, device: str, sizes: dict, degrees: list[int]) -> dict:
    """`name` on one device, then split over each of `degrees` devices: greedy tokens and batch-1 speed."""
    from corral.engine import load_model
    from corral.parallel.shards import TensorParallelError

    one = load_model(name, device=device, precision="auto")
    ids = one.tokenize(PROMPTS[0], add_special=True)
    expected = greedy(one, ids, sizes["greedy"])
    results = {1: batch1(one, device, sizes["prefill"], sizes["decode"])}
    del one
    release()
    for n in degrees:
        try:
            split = load_model(name, device=device, precision="auto", tensor_parallel=n)
        except TensorParallelError as error:  # heads that n does not divide: refused before any rank starts
            print(f"tp={n}: refused: {error}", flush=True)
            results[n] = {"refused": str(error)}
            continue
        try:
            result = {"greedy_match": greedy(split, ids, sizes["greedy"]) == expected}
            result.update(batch1(split, device, sizes["prefill"], sizes["decode"]))
        finally:
            split.close()
            release()
        results[n] = result
        print(f"tp={n}: prefill {result['prefill_tok_s']:.0f} tok/s, decode {result['decode_tok_s']:.1f} tok/s (batch 1; "
              f"tp=1: {results[1]['decode_tok_s']:.1f}), greedy tokens as tp=1: {result['greedy_match']}", flush=True)
    return results


# --- CUDA graphs ------------------------------------------------------------------------------
def graphs(name: str, device: str, sizes: dict) -> dict:
    """Per decode shape: capture the recorded decode step as a CUDA graph, replay it, compare and time."""
    from corral.engine import load_model

    if not device.startswith("cuda"):
        print("graphs: CUDA only; skipped")
        return {"skipped": "CUDA only"}
    model = load_model(name, device=device, precision="auto")
    results = {n: guarded(f"{name} CUDA graph x{n}", graph_one, model, device, n, sizes) for n in sizes["batches"]}
    del model
    release()
    return results


def graph_one(model, device: str, n: int, sizes: dict) -> dict:
    import torch

    prompt, steps = sizes["batch_prompt"], sizes["graph_steps"]
    cache, batch = decode_batch(model, n)(prompt, steps)
    tokens = prefill_sequences(model, cache, n, prompt)
    b = batch(tokens, prompt)
    view = cache.prepare(b)
    eager = model.backend.run(model.model, b, view)  # records the graph of this shape
    model.backend.run(model.model, b, view)  # its second run compiles the plan
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        eager = model.backend.run(model.model, b, view)  # the same step again: the same cells written with the same values
    sync(device)
    eager_ms = 1e3 * (time.perf_counter() - start) / steps
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            model.backend.run(model.model, b, view)  # warm-up on the side stream, as torch asks before capture
            with torch.cuda.graph(graph, stream=stream):
                captured = model.backend.run(model.model, b, view)
    except Exception as error:  # what stops capture is the finding: reported, not a crash
        print(f"capture of the {n}-row decode step failed: {type(error).__name__}: {error}", flush=True)
        return {"rows": n, "captured": False, "error": f"{type(error).__name__}: {str(error)[:300]}", "eager_step_ms": eager_ms}
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    sync(device)
    rel = float((captured.float() - eager.float()).abs().max() / eager.float().abs().max())
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    sync(device)
    replay_ms = 1e3 * (time.perf_counter() - start) / steps
    print(f"{n} rows: eager {eager_ms:.2f} ms, replay {replay_ms:.2f} ms, replay vs eager rel diff {rel:.2e}", flush=True)
    return {"rows": n, "captured": True, "eager_step_ms": eager_ms, "replay_step_ms": replay_ms, "replay_rel_diff": rel}


# --- plan and tables --------------------------------------------------------------------------
def plan(args: argparse.Namespace, sizes: dict) -> dict:
    """What the run would do: sections, models, architectures and sizes, computed without loading anything."""
    return {"device": args.device, "sections": args.sections, "models": args.models, "architectures": args.architectures or architectures(args.references),
            "sizes": sizes, "budget_s": args.budget_s, "tensor_parallel": tp_degrees(args.device) if "tp" in args.sections else []}


def print_tables(results: dict) -> None:
    conformance_results = results.get("conformance") or {}
    if conformance_results:
        print("\n| architecture | fp32 vs CPU fp32 (rel) | auto vs CPU fp32 (rel) |\n|---|---|---|")
        for name, r in conformance_results.items():
            print(f"| {name} | {r['fp32_rel_diff']:.1e} | {r['auto_rel_diff']:.1e} |" if r else f"| {name} | crashed | crashed |")
    models = results.get("models") or {}
    if not models:
        return
    names = list(models)
    print("\n| figure | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))

    def row(label: str, get) -> None:
        cells = []
        for name in names:
            try:
                value = get(models[name])
            except (KeyError, TypeError):
                value = None
            cells.append("—" if value is None else value)
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("fp32 logits vs CPU fp32 (rel)", lambda m: f"{m['correctness']['fp32_vs_cpu_fp32']['max_rel_diff']:.1e}")
    row("auto argmax agreement", lambda m: f"{m['correctness']['auto_vs_cpu_fp32']['argmax_agree']:.0%}")
    row("load (s)", lambda m: f"{m['speed']['load_s']:.2f}")
    row("prefill tok/s", lambda m: f"{m['speed']['prefill_tok_s']:.0f} ({m['speed']['prefill_tokens']} tokens)")
    row("decode tok/s, batch 1", lambda m: f"{m['speed']['decode_tok_s']:.1f}")
    sizes = results["plan"]["sizes"]
    for n in sizes["batches"]:
        row(f"decode tok/s, {n} sequences", lambda m, n=n: f"{m['speed']['batched'][n]['aggregate_tok_s']:.0f} ({m['speed']['batched'][n]['step_ms']:.2f} ms a step)")
    row("fp32 (dense) decode tok/s, batch 1", lambda m: f"{m['speed']['fp32']['decode_tok_s']:.1f}")
    row("peak device memory (MB)", lambda m: f"{m['speed']['max_memory_allocated_mb']:.0f}")
    for n in sizes["http_streams"]:
        row(f"HTTP, {n} streams: tok/s, first token", lambda m, n=n: f"{m['http'][n]['aggregate_tok_s']:.0f}, {m['http'][n]['ttft_ms']:.0f} ms")
    for n in results["plan"]["tensor_parallel"]:
        row(f"tp={n}: decode tok/s, batch 1 (tp=1), same greedy tokens",
            lambda m, n=n: (f"refused ({m['tp'][n]['refused'][:40]})" if "refused" in m["tp"][n] else
                            f"{m['tp'][n]['decode_tok_s']:.1f} ({m['tp'][1]['decode_tok_s']:.1f}), {m['tp'][n]['greedy_match']}"))
    for n in sizes["batches"]:
        row(f"CUDA graph, {n} rows: eager / replay ms",
            lambda m, n=n: (f"{m['graphs'][n]['eager_step_ms']:.2f} / {m['graphs'][n]['replay_step_ms']:.2f}" if m["graphs"][n]["captured"]
                            else f"capture failed: {m['graphs'][n]['error'][:60]}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["smollm2", "gemma3:270m"], help="store names or GGUF paths (none: tiny models only)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (prefill 64, decode 8, batches 1 and 4)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--references", type=pathlib.Path, help="a folder of converted reference models (tests/reference_models.py)")
    parser.add_argument("--architectures", nargs="+", help="conformance architectures to run (default: all)")
    parser.add_argument("--budget-s", type=float, default=540, help="sections starting later than this are skipped")
    parser.add_argument("--plan", action="store_true", help="print what would run, as JSON, and exit")
    parser.add_argument("--out", default="gpu_results.json")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    results: dict = {"plan": plan(args, sizes), "models": {}}
    if args.plan:
        print(json.dumps(results["plan"]))
        return 0
    budget = Budget(args.budget_s)
    want = set(args.sections)
    if "environment" in want:
        results["environment"] = guarded("environment", environment, args.device)
    if "conformance" in want:
        results["conformance"] = guarded("conformance", conformance, args.device, results["plan"]["architectures"], args.references, budget=budget)
    for name in args.models:
        entry = results["models"][name] = {}
        for section, fn, extra in (("correctness", correctness, (args.device, sizes)), ("speed", speed, (args.device, sizes)), ("http", http, (sizes,))):
            if section in want:
                entry[section] = guarded(f"{name} {section}", fn, name, *extra, budget=budget)
    if "tp" in want and results["plan"]["tensor_parallel"]:
        for name in args.models:
            results["models"][name]["tp"] = guarded(f"{name} tp", tensor_parallel, name, args.device, sizes,
                                                    results["plan"]["tensor_parallel"], budget=budget)
    elif "tp" in want:
        print("\n=== tp\ntp: needs more than one CUDA device; skipped", flush=True)
    if "graphs" in want:  # last: a failed capture may leave the device unusable
        for name in args.models:
            results["models"][name]["graphs"] = guarded(f"{name} graphs", graphs, name, args.device, sizes, budget=budget)
    results["problems"] = problems
    results["wall_s"] = time.perf_counter() - budget.start

    print_tables(results)
    print(f"\n{len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems))
    line = json.dumps(results, default=float)
    with open(args.out, "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
