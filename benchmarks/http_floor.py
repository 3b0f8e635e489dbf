"""What the HTTP stack alone costs a held stream: Quart-Trio on Hypercorn, as corral serves, with no corral code.

    python benchmarks/http_floor.py [--port 0] [--to-thread]   # prints its URL, serves until Ctrl-C
    python benchmarks/load.py --url <that URL> --model any --clients 500 --duration 40

POST /api/generate with an empty prompt answers `{}` at once (load.py's warm-up request); any other
prompt starts an NDJSON stream that sends nothing until the client goes away, so every client holds
one open stream. The server's RSS with N clients, less its RSS idle, over N is the stack's cost of
one stream (load.py reports both: `rss_loaded`, `rss_peak_server_mib`). `--to-thread` also makes
one `trio.to_thread.run_sync` call a request, as corral's handlers do.
"""

from __future__ import annotations

import argparse
import json
import socket

import quart
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio


def make_app(to_thread: bool) -> QuartTrio:
    app = QuartTrio("http_floor")
    never = trio.Event()

    @app.post("/api/generate")
    async def generate():
        body = await quart.request.get_json()
        if body.get("prompt") == "":
            return {}
        if to_thread:
            await trio.to_thread.run_sync(json.dumps, body)

        async def nothing():
            await never.wait()
            yield b""

        response = quart.Response(nothing(), mimetype="application/x-ndjson")
        response.timeout = None
        return response

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--to-thread", action="store_true")
    args = parser.parse_args()
    port = args.port
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    print(f"http://127.0.0.1:{port}", flush=True)
    trio.run(serve, make_app(args.to_thread), config)


if __name__ == "__main__":
    main()
