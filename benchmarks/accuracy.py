"""How far corral's fast paths (and llama.cpp, when installed) are from the float32 reference.

    python benchmarks/accuracy.py [--models smollm2 gemma3] [--no-llama-cpp] [--kv-cache-types f16 q8_0 q4_0]
    python benchmarks/accuracy.py --reference F32.gguf --files Q.gguf... --text FILE
        [--ctx 256] [--chunks 8] [--llama-perplexity PATH/llama-perplexity] [--exact]

Teacher forcing over tests/reference (Hugging Face transformers in float32 on the files' exact
weights): the prompt in one forward (the prompt path), then the reference's greedy tokens one at a
time through the KV cache (the decode path). For each, the deviation of the logits of the
reference's top 10 from the reference's values (max and mean), how often the argmax agrees, and
the misses at clear-margin steps (top-2 margin > 1.0, what the tests require). llama.cpp is
measured the same way with `logits_all`. Prints a markdown table. With --kv-cache-types, corral
runs once per KV cache type (Ollama's OLLAMA_KV_CACHE_TYPE; default f16 only): the rows of q8_0 and
q4_0 show what holding the cached keys and values in ggml's blocks costs, mostly on the decode path.

With --reference, quantized files made from one float file (e.g. by llama-quantize) are measured
against corral at precision "fp32" on that file, over `--text` cut as llama-perplexity cuts it:
chunks of `--ctx` tokens (the first set to BOS where the vocabulary adds one), each scored on its
second half. Per file: perplexity, mean KL divergence from the reference's distribution, how often
the top token agrees (all from one forward per chunk, the prompt path), and the same two over the
first chunk's second half decoded a token at a time through the KV cache (the decode path). With
--llama-perplexity, llama.cpp's figures on the same files come from its own tool (its float file
as the base of `--kl-divergence`), and its base is compared with corral's reference. With --exact,
each file also at precision "fp32" (its weights dequantized exactly, float32 everywhere): the error
of the file's weights alone, what remains with exact arithmetic.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import tempfile

import numpy as np

import corral
from corral.engine import resolve_model_path
from corral.model import Batch
from corral.options import KV_CACHE_TYPES

REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "reference"
NAMES = {"smollm2": "smollm2", "gemma3": "gemma3:270m"}
CLEAR_MARGIN = 1.0
KLD_FLOOR = -16.0


def corral_logits(model, prompt: list[int], steps: list[int], cache_type: str = "f16") -> tuple[np.ndarray, np.ndarray]:
    """Prompt rows from one forward; then one row per step, decoding the reference's tokens, over a `cache_type` KV cache."""
    cache = model.new_cache(len(prompt) + len(steps) + 1, cache_type=cache_type)
    prompt_rows = model.forward(Batch.single(prompt, all_logits=True), cache)
    rows = [prompt_rows[-1]]
    for i, token in enumerate(steps[:-1]):
        rows.append(model.forward(Batch.single([token], start=len(prompt) + i), cache)[-1])
    return prompt_rows, np.stack(rows)


def llama_cpp_logits(path: str, prompt: list[int], steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(prompt) + len(steps) + 8, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    prompt_rows = np.array(llm.scores[: len(prompt)])
    rows = [prompt_rows[-1]]
    for token in steps[:-1]:
        llm.eval([token])
        rows.append(np.array(llm.scores[llm.n_tokens - 1]))
    return prompt_rows, np.stack(rows)


def deviations(ref: dict, prompt_rows: np.ndarray, step_rows: np.ndarray) -> dict:
    prompt_dev = np.abs(np.take_along_axis(prompt_rows, ref["prompt_top10_ids"], 1) - ref["prompt_top10_logits"])
    step_dev = np.abs(np.take_along_axis(step_rows, ref["step_top10_ids"], 1) - ref["step_top10_logits"])
    expected, got = ref["step_top10_ids"][:, 0], step_rows.argmax(-1)
    clear = ref["step_top10_logits"][:, 0] - ref["step_top10_logits"][:, 1] > CLEAR_MARGIN
    return {
        "prompt": f"{prompt_dev.max():.2f} / {prompt_dev.mean():.2f}",
        "steps": f"{step_dev.max():.2f} / {step_dev.mean():.2f}",
        "argmax": f"{int((got == expected).sum())}/{len(expected)}",
        "clear_misses": int((clear & (got != expected)).sum()),
    }


def text_chunks(model, text: str, ctx: int, count: int) -> list[list[int]]:
    """`text`'s tokens cut as llama-perplexity cuts them: whole chunks of `ctx`, each starting with BOS if the vocabulary adds one."""
    tokens = model.tokenize(text, add_special=True, parse_special=False)
    chunks = [tokens[i * ctx : (i + 1) * ctx] for i in range(min(count, len(tokens) // ctx))]
    if not chunks:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than one chunk of {ctx}")
    if model.tokenizer.add_bos:
        chunks = [[model.tokenizer.bos_id] + chunk[1:] for chunk in chunks]
    return chunks


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    rows -= rows.max(-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(-1, keepdims=True))


def scored_rows(model, chunk: list[int], decode: bool = False) -> np.ndarray:
    """Log-probabilities of rows ctx/2 .. ctx-2 (each predicting the next token): one forward, or the second half decoded a token at a time."""
    first = len(chunk) // 2
    if not decode:
        return log_softmax(model.logits(chunk)[first:-1])
    cache = model.new_cache(len(chunk))
    model.forward(Batch.single(chunk[:first]), cache)
    rows = [model.forward(Batch.single([chunk[p]], start=p), cache)[-1] for p in range(first, len(chunk) - 1)]
    return log_softmax(np.stack(rows))


def divergence(reference: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> dict:
    """Sums over rows: negative log-likelihood of the targets, KL(reference || rows), top tokens that agree.

    As llama-perplexity, the KL sum skips the tokens the reference gives a log-probability of -16 or less.
    """
    kept = reference > KLD_FLOOR
    return {
        "nll": float(-rows[np.arange(len(targets)), targets].sum()),
        "kld": float((np.exp(reference, where=kept, out=np.zeros(reference.shape)) * np.where(kept, reference - rows, 0)).sum()),
        "same_top": int((reference.argmax(-1) == rows.argmax(-1)).sum()),
        "count": len(targets),
    }


def summed(parts: list[dict]) -> dict:
    total = {key: sum(part[key] for part in parts) for key in parts[0]}
    return {
        "ppl": float(np.exp(total["nll"] / total["count"])),
        "kld": total["kld"] / total["count"],
        "same_top": total["same_top"] / total["count"],
    }


def read_llama_base(path: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """A llama-perplexity `--kl-divergence-base` file: the chunks' tokens and each chunk's scored log-probabilities."""
    data = pathlib.Path(path).read_bytes()
    if data[:8] != b"_logits_":
        raise SystemExit(f"{path} is not a llama-perplexity logits file")
    ctx, vocab, count = np.frombuffer(data, np.int32, 3, 8)
    tokens = np.frombuffer(data, np.int32, ctx * count, 20).reshape(count, ctx)
    width, rows = 2 * ((vocab + 1) // 2) + 4, ctx - 1 - ctx // 2
    codes = np.frombuffer(data, np.uint16, count * rows * width, 20 + 4 * ctx * count).reshape(count, rows, width)
    chunks = []
    for chunk in codes:
        scale, low = chunk[:, :4].copy().view(np.float32).T  # two floats in the row's first four codes
        chunks.append(scale[:, None] * chunk[:, 4 : 4 + vocab] + low[:, None])  # code 0: at or below the floor
    return tokens, chunks


def llama_perplexity(binary: str, path: str, args: list[str]) -> dict:
    """llama-perplexity's figures for `path`: its final perplexity, and with --kl-divergence its KLD and top-token agreement."""
    run = subprocess.run([binary, "-m", path, "-t", "2", *args], capture_output=True, text=True)
    out = run.stdout + run.stderr
    if run.returncode:
        raise SystemExit(f"llama-perplexity failed on {path}:\n{out[-2000:]}")
    figures = {}
    for key, pattern in [
        ("ppl", r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
        ("ppl", r"Final estimate: PPL = ([\d.]+)"),
        ("kld", r"Mean\s+KLD:\s*(-?[\d.]+)"),
        ("same_top", r"Same top p:\s*([\d.]+)"),
    ]:
        if key not in figures and (match := re.search(pattern, out)):
            figures[key] = float(match.group(1)) / (100 if key == "same_top" else 1)
    if "--kl-divergence" in args and "kld" not in figures:
        raise SystemExit(
            "llama-perplexity prints its KL statistics only over 100 scored rows or more: give more --chunks or a larger --ctx"
        )
    return figures


def compare_files(args) -> None:
    text = pathlib.Path(args.text).read_text()
    reference = corral.load_model(args.reference, precision="fp32")
    chunks = text_chunks(reference, text, args.ctx, args.chunks)
    targets = [np.asarray(chunk[len(chunk) // 2 + 1 :]) for chunk in chunks]
    ref_rows = [scored_rows(reference, chunk) for chunk in chunks]
    ref_decode = scored_rows(reference, chunks[0], decode=True)
    del reference
    print(
        f"{len(chunks)} chunks of {args.ctx} tokens of {args.text}, {len(chunks) * len(targets[0])} scored rows; reference: corral fp32 on {args.reference}"
    )
    print(
        f"reference: perplexity {summed([divergence(r, r, t) for r, t in zip(ref_rows, targets)])['ppl']:.4f}; its decode path against its prompt path: "
        f"KLD {divergence(ref_rows[0], ref_decode, targets[0])['kld'] / len(targets[0]):.2e}"
    )

    base_file = None
    if args.llama_perplexity:
        base_file = tempfile.NamedTemporaryFile(suffix=".kld")
        common = ["-c", str(args.ctx), "-b", str(args.ctx)]
        base = llama_perplexity(
            args.llama_perplexity,
            args.reference,
            [*common, "-f", args.text, "--chunks", str(args.chunks), "--kl-divergence-base", base_file.name],
        )
        tokens, llama_rows = read_llama_base(base_file.name)
        same_tokens = all(list(tokens[i][1:]) == chunk[1:] for i, chunk in enumerate(chunks)) and len(tokens) == len(chunks)
        agreement = summed([divergence(lr, r, t) for r, lr, t in zip(ref_rows, llama_rows, targets)])
        print(
            f"llama.cpp on the reference file: perplexity {base['ppl']:.4f}; its tokens {'equal' if same_tokens else 'DIFFER FROM'} corral's; "
            f"KL(llama.cpp's base || corral's reference) {agreement['kld']:.2e}, top tokens agree {100 * agreement['same_top']:.2f}%"
        )

    print()
    print(
        "| file | engine | perplexity | mean KLD from the reference | same top token | chunk 1, KLD: prompt path / decode path | chunk 1, same top: prompt / decode |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        model = corral.load_model(path)
        parts = [divergence(r, scored_rows(model, chunk), t) for r, chunk, t in zip(ref_rows, chunks, targets)]
        prompt, first = summed(parts), summed(parts[:1])
        decode = summed([divergence(ref_rows[0], scored_rows(model, chunks[0], decode=True), targets[0])])
        name = pathlib.Path(path).name
        print(
            f"| {name} | corral | {prompt['ppl']:.4f} | {prompt['kld']:.5f} | {100 * prompt['same_top']:.2f}% | "
            f"{first['kld']:.5f} / {decode['kld']:.5f} | {100 * first['same_top']:.2f}% / {100 * decode['same_top']:.2f}% |"
        )
        del model
        if base_file is not None:
            theirs = llama_perplexity(
                args.llama_perplexity,
                path,
                ["-c", str(args.ctx), "-b", str(args.ctx), "--kl-divergence-base", base_file.name, "--kl-divergence"],
            )
            print(f"| {name} | llama.cpp | {theirs['ppl']:.4f} | {theirs['kld']:.5f} | {100 * theirs['same_top']:.2f}% | | |")
        if args.exact:
            model = corral.load_model(path, precision="fp32")
            exact = summed([divergence(r, scored_rows(model, chunk), t) for r, chunk, t in zip(ref_rows, chunks, targets)])
            print(
                f"| {name} | corral fp32 (the file's weights exactly) | {exact['ppl']:.4f} | {exact['kld']:.5f} | {100 * exact['same_top']:.2f}% | | |"
            )
            del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--reference", help="a float GGUF file: measure --files against corral fp32 on it instead")
    parser.add_argument("--files", nargs="+", default=[], help="quantized GGUF files made from --reference")
    parser.add_argument("--text", help="the text scored with --reference (e.g. a README of the llama.cpp sources)")
    parser.add_argument("--ctx", type=int, default=256, help="tokens a chunk, as llama-perplexity's -c")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary, to measure llama.cpp on the same files")
    parser.add_argument("--kv-cache-types", nargs="+", default=["f16"], choices=list(KV_CACHE_TYPES), help="corral's KV cache types to measure")
    parser.add_argument("--exact", action="store_true", help="also each file at precision fp32: the error of its weights alone")
    args = parser.parse_args()
    if args.reference:
        if not args.files or not args.text:
            parser.error("--reference needs --files and --text")
        compare_files(args)
        return
    print(
        "| engine, model [reference] | prompt rows: max / mean deviation | decode steps: max / mean | argmax agrees | misses at clear-margin steps |"
    )
    print("|---|---|---|---|---|")
    for name in args.models:
        model = corral.load_model(NAMES[name])
        engines = [
            ("corral" if kind == "f16" else f"corral kv {kind}", lambda p, s, m=model, kind=kind: corral_logits(m, p, s, kind))
            for kind in args.kv_cache_types
        ]
        if not args.no_llama_cpp:
            engines.append(("llama.cpp", lambda p, s, path=str(resolve_model_path(NAMES[name])): llama_cpp_logits(path, p, s)))
        for engine, run in engines:
            for index in (0, 1):
                ref = dict(np.load(REFERENCE / f"logits_{name}_{index}.npz"))
                prompt, steps = [int(t) for t in ref["input_ids"]], [int(t) for t in ref["greedy_ids"]][: len(ref["step_top10_ids"])]
                row = deviations(ref, *run(prompt, steps))
                print(f"| {engine} {name} [{index}] | {row['prompt']} | {row['steps']} | {row['argmax']} | {row['clear_misses']} |")


if __name__ == "__main__":
    main()
