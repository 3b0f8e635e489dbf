"""llama.cpp through its Python binding (llama-cpp-python), the second table of benchmarks/side_by_side.py.

    pip install llama-cpp-python        # builds llama.cpp from source (~12 min on 2 cores)

Each function runs one measurement in a fresh process and returns its JSON figures. The binding's
batch-1 decode is its per-token Python `eval` + `sample`, which slows llama.cpp's side; the first
table (llama-bench, llama-server) is the fair comparison. The N streams run llama.cpp's continuous
batching through the C API the way llama-server batches them (one `llama_decode` over all
sequences a step, no HTTP).
"""

from __future__ import annotations

import json
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

# N streams through llama.cpp's own continuous batching, as llama-server runs them: one context with
# a sequence per stream, all prompts prefilled in one llama_decode (logits on each prompt's last
# token), then one llama_decode of N tokens (one per sequence) per step, greedy on every row. Same
# workload as corral's run_concurrency_bench: N prompts of P tokens of the same English text, each
# with a distinct first token; G tokens per stream (the first from the prefill's logits, then G - 1
# decode steps), never stopping at end-of-generation.
LLAMA_CPP_STREAMS = r"""
import json, sys, time
import numpy as np
import llama_cpp as L
from llama_cpp._logger import set_verbose

path, streams, prompt_tokens, gen_tokens, threads = sys.argv[1], *map(int, sys.argv[2:6])
set_verbose(False)
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
params = L.llama_context_default_params()  # flash attention "auto" and per-sequence KV, as llama-server's defaults
params.n_seq_max = streams
params.n_ctx = streams * (prompt_tokens + gen_tokens + 8)
params.n_batch = max(streams * prompt_tokens, 512)
params.n_ubatch = 512
params.n_threads = params.n_threads_batch = threads
ctx = L.llama_init_from_model(model, params)
memory = L.llama_get_memory(ctx)
batch = L.llama_batch_init(params.n_batch, 0, 1)

text = ("The history of astronomy spans thousands of years, from the first people who tracked the moon "
        "and planets to the telescopes that map galaxies billions of light years away. ").encode()
buf = (L.llama_token * 4096)()
piece = list(buf[:L.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)])
base = (piece * (prompt_tokens // len(piece) + 1))[:prompt_tokens]
prompts = [[base[(i * 7) % len(base)]] + base[1:] for i in range(streams)]

def decode(rows):
    # rows: (token, position, sequence, logits wanted); returns the argmax of each wanted row's logits
    for i, (token, pos, seq, out) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(rows)
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i, row in enumerate(rows) if row[3]]

def generate(seqs):
    # Greedy tokens of each prompt in `seqs`, all sequences in every llama_decode.
    out = [[t] for t in decode([(tok, pos, s, pos == prompt_tokens - 1) for s in seqs for pos, tok in enumerate(prompts[s])])]
    for step in range(gen_tokens - 1):
        for tokens, t in zip(out, decode([(out[k][-1], prompt_tokens + step, s, True) for k, s in enumerate(seqs)])):
            tokens.append(t)
    return out

decode([(t, pos, 0, pos == 7) for pos, t in enumerate(base[:8])]); L.llama_memory_clear(memory, True)  # warm up
start = time.perf_counter()
batched = generate(range(streams))
wall = time.perf_counter() - start
L.llama_memory_clear(memory, True)
single = generate([0])[0]  # the same stream alone: informational check of batch invariance
print(json.dumps({"aggregate_tok_s": streams * gen_tokens / wall, "wall_s": wall,
                  "batched_matches_single": batched[0] == single,
                  "first_mismatch": next((i for i, (a, b) in enumerate(zip(batched[0], single)) if a != b), None)}))
L.llama_batch_free(batch); L.llama_free(ctx); L.llama_model_free(model)
"""


def run_json(command: list[str]) -> dict:
    """Run `command` in a fresh process; its last line of output is a JSON object."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama_cpp(path: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    return run_json([sys.executable, "-c", LLAMA_CPP, path, str(prompt_tokens), str(gen_tokens), str(threads)])


def run_llama_cpp_streams(path: str, streams: int, prompt_tokens: int, gen_tokens: int, threads: int) -> dict:
    return run_json([sys.executable, "-c", LLAMA_CPP_STREAMS, path, str(streams), str(prompt_tokens), str(gen_tokens), str(threads)])
