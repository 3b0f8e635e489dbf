"""corral.ray on a local Ray instance: two replicas of a tiny model behind the OpenAI ingress (one Ray instance
and one application for the whole module, which is what keeps it quick). The module is `slow`: the instance
takes about a minute to start on two busy cores, and importing ray alone takes seconds, which the fast
subset does not pay (conftest leaves a module marked as a whole uncollected when the marks exclude it)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="corral.ray needs the `ray` extra: pip install -e \".[ray]\"")
serve = pytest.importorskip("ray.serve", reason="corral.ray needs ray[serve]: pip install -e \".[ray]\"")

from conftest import TINY_LLAMA, copy_store  # noqa: E402

from corral.ray import ReplicaSettings, SettingsError, app, build  # noqa: E402
from corral.ray.replica import REPLICA_HEADER  # noqa: E402
from corral.ray.routing import PREFIX_CHARS, rank, routing_key  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray instance (and ray itself): out of the fast subset (-m "not slow")

APP = "corral"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ingress(tiny_store_root, tmp_path_factory):
    """Two replicas of the tiny llama (in-process runners, half a CPU each) behind the ingress; yields its URL."""
    store = copy_store(tiny_store_root, tmp_path_factory.mktemp("ray-store") / "models")
    # address="local": a new instance of this test's own, never one another process (a `serve run`) has started.
    ray.init(address="local", num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    # Ray Serve's proxy binds the port it is given and reports no port of its own choosing: a free one, from the OS.
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ReplicaSettings(model=TINY_LLAMA, num_replicas=2, num_cpus=0.5, store=str(store), runner="inprocess")
    serve.run(build(settings), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(url: str, content: str, system: str = "You are terse.", **extra) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    body = {"model": TINY_LLAMA, "messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _replica_actors() -> set[str]:
    """The names of the CorralReplica actors alive now ("SERVE_REPLICA::corral#CorralReplica#<replica id>")."""
    return {
        name["name"] for name in ray.util.list_named_actors(all_namespaces=True)
        if name["namespace"] == "serve" and "#CorralReplica#" in name["name"]
    }


def _replica_id(actor: str) -> str:
    """The replica id (what REPLICA_HEADER names) in a replica actor's name."""
    return actor.rsplit("#", 1)[-1]


def _running_replicas() -> int:
    return serve.status().applications[APP].deployments["CorralReplica"].replica_states.get("RUNNING", 0)


def test_two_replicas_both_serve(ingress):
    answered = set()
    for index in range(16):  # 16 prefixes all hashing to one of two replicas: odds 2 in 65,536
        response = _chat(ingress, f"question {index}", system=f"system prompt {index}")
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
        answered.add(response.headers[REPLICA_HEADER])
    assert len(answered) == 2


def test_requests_sharing_a_prefix_go_to_one_replica(ingress):
    system = "A long shared system prompt. " * (PREFIX_CHARS // 20)
    answered = {_chat(ingress, f"question {index}", system=system).headers[REPLICA_HEADER] for index in range(6)}
    assert len(answered) == 1


def test_streaming_through_the_ingress(ingress):
    body = {"model": TINY_LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{ingress}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_completions_embeddings_and_models_through_the_ingress(ingress):
    completion = httpx.post(f"{ingress}/v1/completions", json={"model": TINY_LLAMA, "prompt": "Once", "max_tokens": 2}, timeout=60)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    embedding = httpx.post(f"{ingress}/v1/embeddings", json={"model": TINY_LLAMA, "input": ["a", "b"]}, timeout=60)
    # No tiny embedding model exists: the route reaches a replica, whose corral answers with its capability error.
    assert embedding.status_code == 400 and "does not support embeddings" in embedding.json()["error"]["message"]
    models = httpx.get(f"{ingress}/v1/models", timeout=60).json()
    assert TINY_LLAMA in [model["id"] for model in models["data"]]


def test_bad_requests_get_corrals_own_errors(ingress):
    bad_json = httpx.post(f"{ingress}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=60)
    assert bad_json.status_code == 400 and "message" in bad_json.json()["error"]
    unknown = _chat(ingress, "hi", model="no-such-model")
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]
    bad_range = _chat(ingress, "hi", temperature=7)
    assert bad_range.status_code == 400
    not_served = httpx.post(f"{ingress}/api/pull", json={"model": "x"}, timeout=60)
    assert not_served.status_code == 404 and "not served" in not_served.json()["error"]["message"]


# A replacement replica is a new worker process that imports torch, starts its server and loads the model: on two
# busy cores that has taken up to a minute; then the ingress's router hears of it from Ray Serve's controller.
REPLACEMENT_TIMEOUT = 180


def test_a_killed_replica_is_replaced_while_requests_keep_succeeding(ingress):
    before = _replica_actors()
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # Every request sent while Ray Serve notices the death and starts a replacement must succeed; each one is also
    # the pace of the wait (a request takes tens of milliseconds), so no sleep is needed.
    statuses, deadline = [], time.monotonic() + REPLACEMENT_TIMEOUT
    while time.monotonic() < deadline:
        statuses.append(_chat(ingress, f"after the kill {len(statuses)}").status_code)
        now = _replica_actors()
        if victim not in now and len(now) == 2 and _running_replicas() == 2:
            break
    now = _replica_actors()
    assert victim not in now and len(now) == 2, f"the killed replica was not replaced in {REPLACEMENT_TIMEOUT} s"
    assert statuses and set(statuses) == {200}
    # The new replica serves too: requests with distinct prefixes reach both live replicas, and only them.
    live, answered, index = {_replica_id(actor) for actor in now}, set(), 0
    while answered != live and time.monotonic() < deadline + 60:
        response = _chat(ingress, f"after the replacement {index}", system=f"s{index}")
        assert response.status_code == 200, response.text
        answered.add(response.headers[REPLICA_HEADER])
        index += 1
    assert answered == live, f"replicas {sorted(live - answered)} did not answer {index} requests with distinct prefixes"


# --- the routing and the settings, without Ray's cluster -------------------------------------------------


class _Replica:
    def __init__(self, replica_id):
        self.replica_id = replica_id


def test_rank_prefers_one_replica_per_key_and_falls_back_to_the_least_loaded():
    replicas = [_Replica(name) for name in "abc"]
    first = rank("model\nsome prompt", replicas, {})
    assert len(first) == 2 and len(first[0]) == 1 and len(first[1]) == 2
    assert rank("model\nsome prompt", list(reversed(replicas)), {})[0] == first[0]  # order of candidates does not matter
    preferred = first[0][0].replica_id
    others = [replica.replica_id for replica in replicas if replica.replica_id != preferred]
    busy = {preferred: 10, others[0]: 3, others[1]: 1}
    assert [replica.replica_id for replica in rank("model\nsome prompt", replicas, busy)[0]] == [others[1], others[0], preferred]
    assert [replica.replica_id for replica in rank("", replicas, {"a": 2, "b": 0, "c": 1})[0]] == ["b", "c", "a"]


def test_routing_key_is_the_start_of_the_prompt():
    long = "x" * (PREFIX_CHARS * 2)
    assert routing_key("/v1/completions", {"model": "m", "prompt": long + "a"}) == routing_key("/v1/completions", {"model": "m", "prompt": long + "b"})
    assert routing_key("/v1/completions", {"model": "m", "prompt": "a"}) != routing_key("/v1/completions", {"model": "n", "prompt": "a"})
    assert routing_key("/v1/models", None) == "" and routing_key("/v1/chat/completions", [1]) == ""


def test_app_arguments_from_the_command_line():
    settings = ReplicaSettings.from_args({"model": "smollm2", "num_replicas": "2"})
    assert settings.deployment_options()["num_replicas"] == 2
    scaled = ReplicaSettings.from_args({"min_replicas": "1", "max_replicas": "4"}).deployment_options()
    assert "num_replicas" not in scaled and scaled["autoscaling_config"]["max_replicas"] == 4
    with pytest.raises(SettingsError, match="unknown argument"):
        app({"replicas": "2"})
    with pytest.raises(SettingsError, match="not both"):
        app({"num_replicas": "2", "max_replicas": "3"})
    with pytest.raises(SettingsError, match="bad argument"):
        app({"num_replicas": "two"})
