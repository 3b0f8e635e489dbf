"""Embed corral in a Trio application: several concurrent requests batched into shared forward passes.

    python examples/embed_trio.py [MODEL]
"""

import sys

import trio

import corral

QUESTIONS = ["Why is the sky blue?", "What is the capital of France?", "Name three prime numbers."]


async def ask(rt: corral.Runtime, question: str) -> None:
    async with rt.generate(question, options={"temperature": 0, "num_predict": 48}) as stream:
        text, final = await stream.collect()
    print(f"Q: {question}\nA: {text.strip()}\n   ({final.eval_count} tokens, done: {final.done_reason})\n")


async def stream_one(rt: corral.Runtime) -> None:
    # Leaving the `async with` early ends the sequence and frees its slot at once.
    async with rt.chat([{"role": "user", "content": "Count from one to twenty."}], options={"temperature": 0}) as stream:
        async for chunk in stream:
            print(chunk.text, end="", flush=True)
            if "five" in chunk.text.lower():
                break
    print("\n(stopped reading early)\n")


async def main(model: str) -> None:
    async with corral.Runtime.open(model, num_parallel=4, num_ctx=2048) as rt:
        async with trio.open_nursery() as nursery:
            for question in QUESTIONS:
                nursery.start_soon(ask, rt, question)
        await stream_one(rt)
        print("reused prompt tokens:", rt.stats.prompt_tokens_reused)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "smollm2")
