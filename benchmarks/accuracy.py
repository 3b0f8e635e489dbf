"""How far corral's fast paths (and llama.cpp, when installed) are from the float32 reference.

    python benchmarks/accuracy.py [--models smollm2 gemma3] [--no-llama-cpp]

Teacher forcing over tests/reference (Hugging Face transformers in float32 on the files' exact
weights): the prompt in one forward (the prompt path), then the reference's greedy tokens one at a
time through the KV cache (the decode path). For each, the deviation of the logits of the
reference's top 10 from the reference's values (max and mean), how often the argmax agrees, and
the misses at clear-margin steps (top-2 margin > 1.0, what the tests require). llama.cpp is
measured the same way with `logits_all`. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

import corral
from corral.engine import resolve_model_path
from corral.model import Batch

REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "reference"
NAMES = {"smollm2": "smollm2", "gemma3": "gemma3:270m"}
CLEAR_MARGIN = 1.0


def corral_logits(model, prompt: list[int], steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt rows from one forward; then one row per step, decoding the reference's tokens."""
    cache = model.new_cache(len(prompt) + len(steps) + 1)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    print("| engine, model [reference] | prompt rows: max / mean deviation | decode steps: max / mean | argmax agrees | misses at clear-margin steps |")
    print("|---|---|---|---|---|")
    for name in args.models:
        model = corral.load_model(NAMES[name])
        engines = [("corral", lambda p, s, m=model: corral_logits(m, p, s))]
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
