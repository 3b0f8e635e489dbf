"""corral and llama-server under the same HTTP load, one after the other in one run, drawn side by side.

    python benchmarks/sweep_llama_server.py [--model smollm2] [--sweep 1,2,4,8,16] [--plot docs/bench-smollm2.png]

Starts `corral serve` and llama-server (from $LLAMA_SERVER, default ~/.cache/corral-peers/build/bin/llama-server,
built as peers.md says) on free loopback ports over the same GGUF file, with the same number of sequence slots
(the highest concurrency) and the same context per slot, then runs `corral bench MODEL --sweep ... --against
<llama-server> --plot ...` and stops both. Every request is a non-streamed /v1/completions of --gen-tokens greedy
tokens with ignore_eos, so both servers generate the same tokens.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx

from corral.store import default_store

LLAMA_SERVER = pathlib.Path(os.environ.get("LLAMA_SERVER", pathlib.Path.home() / ".cache/corral-peers/build/bin/llama-server"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, path: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready after {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sweep", default="1,2,4,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    # On a machine shared with other work, 1 thread each: spinning thread pools on oversubscribed cores wait a
    # time slice at every barrier (measured: seconds per token with 2 threads on 2 busy cores).
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--plot", default="docs/bench-smollm2.png")
    args = parser.parse_args()

    if not LLAMA_SERVER.exists():
        raise SystemExit(f"no llama-server at {LLAMA_SERVER}: build it as shared/peers.md says, or set LLAMA_SERVER")
    gguf = default_store().model_path(args.model)
    slots = max(int(level) for level in args.sweep.split(","))
    per_slot = 2 * (args.prompt_tokens + args.gen_tokens) + 64  # words are sized approximately: room to spare
    corral_port, llama_port = free_port(), free_port()
    env = {**os.environ, "CORRAL_HOST": f"127.0.0.1:{corral_port}", "CORRAL_NUM_PARALLEL": str(slots),
           "CORRAL_CONTEXT_LENGTH": str(per_slot), "OMP_NUM_THREADS": str(args.threads)}  # torch's threads, as -t is llama-server's
    servers = [
        subprocess.Popen([sys.executable, "-m", "corral.cli", "serve"], env=env, stderr=subprocess.DEVNULL),
        subprocess.Popen([str(LLAMA_SERVER), "-m", str(gguf), "-np", str(slots), "-c", str(slots * per_slot), "-t", str(args.threads),
                          "--host", "127.0.0.1", "--port", str(llama_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    try:
        wait_ready(f"http://127.0.0.1:{corral_port}", "/health", servers[0])
        wait_ready(f"http://127.0.0.1:{llama_port}", "/health", servers[1])
        command = [sys.executable, "-m", "corral.cli", "bench", args.model, "--sweep", args.sweep, "--prompt-tokens", str(args.prompt_tokens),
                   "--gen-tokens", str(args.gen_tokens), "--rounds", str(args.rounds), "--against", f"llama-server=http://127.0.0.1:{llama_port}",
                   "--plot", args.plot]
        print("$", " ".join(command[1:]), flush=True)
        return subprocess.run(command, env=env).returncode
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
