"""`python -m corral.parallel --model PATH --split pipeline`: one rank of a split model, started by hand or by a launcher.

Like torchrun's workers it reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the
environment; rank 0 (the process serving the model, loaded with `master=(MASTER_ADDR, MASTER_PORT)`)
listens there. The rank loads its part of the model, serves rank 0's steps and exits when rank 0
unloads the model or goes away.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from corral.parallel.ranks import serve_rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m corral.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the GGUF file (or store name) rank 0 loads")
    p.add_argument("--split", choices=("pipeline", "tensor"), default="pipeline")
    p.add_argument("--precision", default="auto")
    p.add_argument("--num-thread", type=int, default=0)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not os.environ.get(key)]
    if missing:
        p.error(f"set {', '.join(missing)} (as torchrun does)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < world:
        p.error(f"RANK must be between 1 and WORLD_SIZE - 1 ({world - 1}); rank 0 is the process serving the model")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    load = dict(name_or_path=args.model, precision=args.precision, backend=None, device=args.device, num_thread=args.num_thread)
    serve_rank(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), load, args.split, local=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
