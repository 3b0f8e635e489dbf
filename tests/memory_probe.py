"""`python tests/memory_probe.py MODEL.gguf NUM_CTX`: load a model as a runner does, fill its context with one
prompt, and print {"estimate": bytes, "measured": bytes} as JSON; measured is the growth of this process's
resident memory from just before the load (torch and corral already imported) to after the prompt."""

import json
import sys

import trio


async def main(path: str, num_ctx: int) -> None:
    from corral import memory
    from corral.registry import Plugins
    from corral.runner.runtime import Runtime

    Plugins().open_backend()  # torch and the backend imported: their pages are not the model's
    before = memory.resident_bytes()
    async with Runtime.open(path, num_parallel=1, num_ctx=num_ctx, num_batch=512) as runtime:
        prompt = " ".join(["memory"] * (num_ctx - 16))
        async with runtime.generate(prompt, {"num_predict": 1, "temperature": 0}, raw=True) as stream:
            await stream.collect()
        status = runtime.status()
        print(json.dumps({"estimate": status.memory_estimate, "measured": status.memory_bytes - before}))


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
