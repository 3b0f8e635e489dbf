"""The rank processes of one split model (tensor- or pipeline-parallel), started, fed and stopped by rank 0.

Rank 0 is the process that loads the model (a runner process, or an embedding application); it
starts ranks 1..N-1 with torch.multiprocessing, and all N meet in one gloo process group over a
TCPStore on 127.0.0.1 (or at MASTER_ADDR:MASTER_PORT, for ranks on other hosts). Each rank loads
only its part of the weights (shards.py, pipeline.py). On CUDA each rank takes its own GPU and the
activations (all-reduces, stage transfers) go over a second group, NCCL's, between the GPUs; the
ops rank 0 broadcasts are host bytes and stay on gloo (`collective_backend`, `rank_device`).

Rank 0 keeps the model's only scheduler: the batching actor runs there and, before each step,
broadcasts what the other ranks must do to stay in step with it (`Op`s: the step's batch, and
the cache changes since the last one: sequences removed, context shifts). Every rank then runs the
same forward pass over its own part, meeting the others at each all-reduce or transfer. The other ranks hold
no state of their own beyond their cache tags, which replaying the same ops keeps identical.

A rank that dies closes its sockets: the next collective on any other rank fails at once (gloo's
"connection closed by peer"), rank 0 raises RankFailedError and shuts the rest down, and a rank
whose rank 0 is gone exits. Workers are forked from a forkserver that has imported torch once,
so starting N ranks costs a fork each, not an interpreter and a torch import each.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from corral.errors import CorralError
from corral.parallel.shards import RankFailedError, TensorParallel, TensorParallelError

log = logging.getLogger(__name__)

# Ranks wait between steps for as long as the model stays loaded: their collectives must not time
# out while idle. A dead peer is noticed at once through its closed sockets, not by this timeout.
IDLE_TIMEOUT = datetime.timedelta(days=7)
START_TIMEOUT = 300.0  # seconds for every rank to connect and load its shard
# NCCL's collectives run only inside a step (the ranks idle in gloo's broadcast), so its watchdog may be short:
# a rank that dies mid-step ends the others after this long instead of leaving them blocked for good.
STEP_TIMEOUT = datetime.timedelta(minutes=10)
STOP_TIMEOUT = 10.0
FAILURE_GRACE = 2.0  # seconds to see which rank exited once a collective failed


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["corral.parallel.ranks"])
    return ctx


def _listener(host: str, port: int) -> socket.socket:
    """The rank-0 store's listening socket, bound to `host` only (TCPStore alone would listen on every interface)."""
    listener = socket.create_server((host, port), backlog=64)
    listener.set_inheritable(False)
    return listener


def _group(store: Any, rank: int, world: int, local: bool) -> Any:
    """The gloo process group of all ranks; on one machine its sockets are bound to 127.0.0.1 only."""
    prefixed = dist.PrefixStore("ranks", store)
    if not local:  # across hosts: gloo's own choice of interface (GLOO_SOCKET_IFNAME, else the hostname's)
        return dist.ProcessGroupGloo(prefixed, rank, world, IDLE_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = IDLE_TIMEOUT
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def resolved_device(device: str | None) -> str:
    """The device a rank's backend loads on: the one asked for, else CUDA when present (the torch backend's default)."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def collective_backend(device: str) -> str:
    """torch.distributed's backend for the activations of a model split on `device`: NCCL between CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int, cuda_devices: int) -> str:
    """The device of the rank that is `local_rank` on its host: on CUDA each rank takes its own GPU, counting from the
    index asked for (NCCL cannot put two ranks on one GPU); any other device is shared by the ranks."""
    where = torch.device(device)
    if where.type != "cuda":
        return device
    index = (where.index or 0) + local_rank
    if index >= cuda_devices:
        raise TensorParallelError(
            f"a split model's rank {local_rank} needs CUDA device {index}, and this host has {cuda_devices}: split it over fewer ranks"
        )
    return f"cuda:{index}"


def _data_group(store: Any, rank: int, world: int, device: str, control: Any) -> Any:
    """The group the activations go over: on CUDA an NCCL group of its own, else the gloo group that carries the ops."""
    if collective_backend(device) == "gloo":
        return control
    if not dist.is_nccl_available():
        raise TensorParallelError("this torch build has no NCCL: a model split over CUDA devices needs a CUDA build of torch")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = STEP_TIMEOUT
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, options)


def _broadcast(group: Any, payload: bytes | None) -> bytes:
    """Rank 0's `payload` on every rank (its length first, then its bytes)."""
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    group.broadcast([size]).wait()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None else torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        group.broadcast([data]).wait()
    return data.numpy().tobytes()


def rank_role(split: str, rank: int, world: int, group: Any, load: dict[str, Any], on_failure: Any = None) -> dict[str, Any]:
    """What `load_model` takes to load `rank`'s part of a `split` ("tensor" or "pipeline") model; `group` carries the
    activations and `load["device"]` is this rank's device."""
    if split == "tensor":
        return {"parallel": TensorParallel(rank, world, group, on_failure=on_failure)}
    from corral.gguf import GGUFFile
    from corral.parallel.pipeline import PipelineStage, stage_blocks

    gguf = GGUFFile.open(load["name_or_path"])
    try:
        blocks = int(gguf.metadata[f"{gguf.architecture}.block_count"])
    finally:
        gguf.close()
    stage = PipelineStage(rank, world, stage_blocks(blocks, world, rank), group, on_failure=on_failure, device=torch.device(load["device"]))
    return {"stage": stage}


class RankGroup:
    """Rank 0's handle on ranks 1..N-1: it queues cache changes and broadcasts them with each step.

    With no `master`, rank 0 starts the other ranks here, meeting them on a free port of 127.0.0.1.
    With `master` (host, port: torchrun's MASTER_ADDR and MASTER_PORT), it listens there and waits
    for ranks started elsewhere (`python -m corral.parallel`, with the same settings and their RANK).
    """

    def __init__(self, world: int, load: dict[str, Any], split: str = "tensor", master: tuple[str, int] | None = None):
        self.world = world
        load = {**load, "device": resolved_device(load.get("device"))}  # the ranks' base device (each takes its own GPU)
        self.device = rank_device(load["device"], 0, torch.cuda.device_count())  # rank 0's, which engine.py loads on
        host, port = master or ("127.0.0.1", 0)
        timeout = datetime.timedelta(seconds=START_TIMEOUT)
        listener = _listener(host, port)
        port = listener.getsockname()[1]
        self.store = dist.TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.fileno())
        # The store owns the descriptor now and closes it when it ends: Python must not close it again
        # (that number may by then belong to another file).
        listener.detach()
        self.processes = []
        if master is None:
            ctx = _context()
            self.processes = [
                ctx.Process(target=serve_rank, args=(rank, world, host, port, load, split), daemon=True) for rank in range(1, world)
            ]
            for process in self.processes:
                process.start()
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.processes))
        self._pending: list[tuple] = []
        self._lock = threading.Lock()  # cache changes are queued from the event loop's thread and the compute thread
        self._next_cache = 0
        self.failed: str | None = None
        self.group = _group(self.store, 0, world, local=master is None)  # rank 0's ops to the others: host bytes
        data = _data_group(self.store, 0, world, self.device, self.group)
        self.role = rank_role(split, 0, world, data, {**load, "device": self.device}, on_failure=self._fail)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self.processes]

    def wait_loaded(self) -> None:
        """Return once every other rank has loaded its shard; raise what a rank failed with."""
        deadline = time.monotonic() + START_TIMEOUT
        for rank in range(1, self.world):
            key = f"loaded/{rank}"
            process = self.processes[rank - 1] if self.processes else None
            while not self.store.check([key]):
                if process is not None and not process.is_alive():
                    raise RankFailedError(f"rank {rank} of the split model exited (code {process.exitcode}) while loading its part")
                if time.monotonic() > deadline:
                    raise RankFailedError(f"rank {rank} of the split model did not load its part in {START_TIMEOUT:.0f} s")
                time.sleep(0.05)
            answer = self.store.get(key).decode()
            if answer != "ok":
                raise TensorParallelError(f"rank {rank} of the split model could not load its part: {answer}")

    # --- what the other ranks replay ------------------------------------------------------------
    def new_cache_id(self) -> int:
        with self._lock:
            self._next_cache += 1
            return self._next_cache

    def queue(self, *op: Any) -> None:
        """An op the other ranks apply before the next step."""
        with self._lock:
            self._pending.append(op)

    def step(self, *op: Any) -> None:
        """Send the queued ops and `op` (a step) to every rank now."""
        with self._lock:
            ops, self._pending = self._pending + [op], []
        self._send(pickle.dumps(ops))

    def _send(self, payload: bytes | None) -> None:
        if self.failed:
            raise RankFailedError(self.failed)
        try:
            _broadcast(self.group, payload)
        except RuntimeError as e:
            raise self._fail(e) from e

    def _fail(self, error: Exception) -> RankFailedError:
        """Record that a rank is gone, stop the others, and give the error to raise."""
        # The peer's sockets close as it dies; its exit may take a moment more to be seen.
        multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=FAILURE_GRACE)
        dead = [f"rank {rank} (exit code {p.exitcode})" for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        self.failed = f"a rank of the split model stopped: {', '.join(dead) or 'a peer closed its connection'}; reload the model"
        log.error("%s (%s)", self.failed, error)
        _stop_processes(self.processes)
        return RankFailedError(self.failed)

    def close(self) -> None:
        """Tell every rank to exit and wait for them (killing those that do not)."""
        if not self.failed:
            try:
                self._send(None)
            except CorralError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()


def _stop_processes(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(STOP_TIMEOUT)


# --- ranks 1..N-1 ------------------------------------------------------------------------------


def serve_rank(rank: int, world: int, host: str, port: int, load: dict[str, Any], split: str = "tensor", local: bool = True) -> None:
    """A rank process: join the group at host:port, load this rank's part, replay rank 0's ops until told to stop.

    `local`: every rank is on this machine (started by rank 0), so the group binds to 127.0.0.1 and the rank is
    also its local rank; a rank on another host is its LOCAL_RANK there (as torchrun sets it), else 0.
    """
    from corral.engine import load_model

    store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=START_TIMEOUT))
    group = _group(store, rank, world, local)
    try:
        local_rank = rank if local else int(os.environ.get("LOCAL_RANK", "0"))
        load = {**load, "device": rank_device(resolved_device(load.get("device")), local_rank, torch.cuda.device_count())}
        data = _data_group(store, rank, world, load["device"], group)
        model = load_model(**load, **rank_role(split, rank, world, data, load))
    except Exception as e:  # the load's error goes back to rank 0, which raises it
        store.set(f"loaded/{rank}", f"{type(e).__name__}: {e}")
        return
    store.set(f"loaded/{rank}", "ok")
    replica = Replica(model)
    while True:
        try:
            payload = _broadcast(group, None)
        except RuntimeError:
            os._exit(1)  # rank 0 is gone: nothing left to serve
        if not payload:
            _exit_after_stop()
        try:
            replica.apply(pickle.loads(payload))
        except RuntimeError:
            os._exit(1)  # a peer is gone mid-step


def _exit_after_stop() -> None:
    """Leave once rank 0 has said stop, with status 0 and without the interpreter's shutdown: there the
    process group's C++ threads were destroyed still joinable ("terminate called without an active
    exception", SIGABRT) in about one exit in seven (tests/test_pipeline_parallel.py, 2026-12-02)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


class Replica:
    """A rank's model and caches, changed only by the ops rank 0 sends."""

    def __init__(self, model: Any):
        self.model = model
        self.caches: dict[int, Any] = {}

    def apply(self, ops: list[tuple]) -> None:
        from corral.kvcache import CacheFullError, CausalCache, shift_sequence

        for kind, cache_id, *args in ops:
            if kind == "cache":
                self.caches[cache_id] = CausalCache(self.model.backend, self.model.model.cache_layers(), *args)
            elif kind == "drop":
                self.caches.pop(cache_id, None)
            elif kind == "remove":
                self.caches[cache_id].remove(*args)
            elif kind == "shift":
                shift_sequence(self.model.model, self.caches[cache_id], *args)
            elif kind == "step":
                (batch,) = args
                try:
                    view = self.caches[cache_id].prepare(batch)
                except CacheFullError:
                    continue  # rank 0's cache, in the same state, refused the same batch
                self.model.backend.run(self.model.model, batch, view)
            else:
                raise ValueError(f"unknown op {kind!r} from rank 0")
