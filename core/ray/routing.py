"""Prefix-cache aware routing: a request goes to the replica that most likely holds its prompt's prefix.

Each replica keeps the KV cache of the prompts it served (corral reuses a cached prefix), so sending
requests that share a beginning (one system prompt, one conversation growing turn by turn) to the same
replica saves their prefill. The ingress derives a routing key from the first characters of the
request's prompt (the messages in order, which is how the chat template renders them); the router maps
the key to a replica by rendezvous hashing, so a replica joining or leaving moves only its own keys,
and falls back to the other replicas, least loaded first, when that one is busy. This is Ray Serve's own
request-router API (`ray.serve.request_router`), not a router of corral's.
"""

from __future__ import annotations

import hashlib
import json

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

PREFIX_CHARS = 512  # of the prompt: enough to tell system prompts and first turns apart, short enough to hash per request
# The preferred replica is skipped when it has this many more requests queued than the least loaded one:
# a cached prefix saves one prefill, not a whole queue's wait.
IMBALANCE = 4


def routing_key(path: str, body: object) -> str:
    """The key of an OpenAI request: its model and the first PREFIX_CHARS characters of its prompt ("" when it has none)."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/chat/completions":
        prompt = body.get("messages")
    elif path == "/v1/completions":
        prompt = body.get("prompt")
    elif path == "/v1/embeddings":
        prompt = body.get("input")
    else:
        return ""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return f"{body.get('model')}\n{text[:PREFIX_CHARS]}"


def preference(key: str, replica_id: str) -> int:
    """The rendezvous weight of a replica for a key: the highest weight wins."""
    return int.from_bytes(hashlib.blake2b(f"{replica_id}\n{key}".encode(), digest_size=8).digest(), "big")


def rank(key: str, replicas: list, queue_lengths: dict) -> list[list]:
    """Replicas in order of preference for `key`: its rendezvous replica first (unless it is IMBALANCE requests busier
    than the least loaded), then the rest, least loaded first. No key (a `/v1/models`): least loaded first.

    `replicas` have a `replica_id`; `queue_lengths` maps replica ids to their queued requests (unknown: 0)."""
    if not replicas:
        return []
    load = {replica.replica_id: queue_lengths.get(replica.replica_id) or 0 for replica in replicas}
    by_load = sorted(replicas, key=lambda replica: load[replica.replica_id])
    if not key:
        return [by_load]
    preferred = max(replicas, key=lambda replica: preference(key, str(replica.replica_id)))
    if load[preferred.replica_id] - load[by_load[0].replica_id] >= IMBALANCE:
        return [by_load]
    return [[preferred], [replica for replica in by_load if replica is not preferred]]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router for `CorralReplica`: the first argument of every call is the routing key."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.args[0] if pending_request is not None and pending_request.args else ""
        return rank(key if isinstance(key, str) else "", candidate_replicas, self._queue_lengths(candidate_replicas))

    def _queue_lengths(self, replicas: list[RunningReplica]) -> dict:
        # Ray's router keeps each replica's last reported queue length; it has no public accessor in 2.60.
        cache = getattr(self, "_replica_queue_len_cache", None)
        return {replica.replica_id: cache.get(replica.replica_id) for replica in replicas} if cache is not None else {}
