"""Running one model over several processes with torch.distributed.

* `shards.py`: tensor parallelism's cut of a model (which heads, rows and columns a rank holds);
* `pipeline.py`: pipeline parallelism's cut (which blocks each stage runs) and its transfers;
* `ranks.py`: the rank processes of one split model, started (or awaited) and fed by rank 0;
* `mirror.py`: rank 0's KV cache, whose every change the other ranks replay on their own part;
* `__main__.py`: one rank started by hand on another host, torchrun-style.
"""
