"""An Ollama models directory, laid out exactly as Ollama writes it, used as corral's store in place.

The store holds a tiny llama as Ollama's manifest names it (registry.ollama.ai/library/...), with
Ollama's compact manifest JSON, its config blob, a Go template layer and a params layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket

import httpx
import pytest
from click.testing import CliRunner

from corral import store
from corral.cli import main
from corral.engine import load_model
from corral.modelfile import model_defaults
from corral.server.serve import serve
from tiny_gguf import write_tiny_llama

DATA = pathlib.Path(__file__).parent / "data" / "ollama_templates"
ZEPHYR_GO = (DATA / "zephyr.gotmpl").read_bytes().decode()
MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def _blob(root: pathlib.Path, content: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(content).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_bytes(content)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(content)}


def write_ollama_store(root: pathlib.Path, gguf: str | pathlib.Path, template: str = ZEPHYR_GO) -> pathlib.Path:
    """`ollama pull`'s result for one model: blobs named sha256-<hex>, a manifest under registry.ollama.ai."""
    (root / "blobs").mkdir(parents=True)
    model = _blob(root, pathlib.Path(gguf).read_bytes(), "application/vnd.ollama.image.model")
    layers = [
        model,
        _blob(root, template.encode(), "application/vnd.ollama.image.template"),
        _blob(root, b'{"stop":["<|system|>","<|user|>","<|assistant|>","</s>"],"temperature":0.5}', "application/vnd.ollama.image.params"),
        _blob(root, b"You are a tiny zephyr.", "application/vnd.ollama.image.system"),
    ]
    config = {
        "model_format": "gguf", "model_family": "llama", "model_families": ["llama"], "model_type": "1M",
        "file_type": "F32", "architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [m["digest"] for m in layers]},
    }  # fmt: skip
    config_layer = _blob(root, json.dumps(config, separators=(",", ":")).encode(), "application/vnd.docker.container.image.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config_layer, "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / "library" / "tinyzephyr" / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest, separators=(",", ":")))
    return root


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh HOME with an Ollama store in ~/.ollama/models and no corral store; no store variables set."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CORRAL_MODELS", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    write_ollama_store(tmp_path / "home" / ".ollama" / "models", write_tiny_llama(tmp_path / "tiny.gguf"))
    with socket.socket() as sock:  # nothing listens there: the CLI works in-process
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")
    return tmp_path / "home"


def test_an_existing_ollama_store_is_the_default_when_corral_has_none(home):
    assert store.default_store().root == home / ".ollama" / "models"


def test_an_existing_corral_store_comes_first(home):
    (home / ".corral" / "models").mkdir(parents=True)
    assert store.default_store().root == home / ".corral" / "models"


def test_the_variables_come_before_both(home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-elsewhere"))
    assert store.default_store().root == tmp_path / "ollama-elsewhere"
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "corral-elsewhere"))
    assert store.default_store().root == tmp_path / "corral-elsewhere"


def test_ollama_models_points_at_an_ollama_store(home, tmp_path, monkeypatch):
    moved = tmp_path / "moved"
    os.rename(home / ".ollama" / "models", moved)
    monkeypatch.setenv("OLLAMA_MODELS", str(moved))
    result = CliRunner().invoke(main, ["list"], catch_exceptions=False)
    assert result.exit_code == 0 and "tinyzephyr:latest" in result.output


def test_corral_list_shows_the_ollama_store_models(home):
    result = CliRunner().invoke(main, ["list"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "tinyzephyr:latest" in result.output


def test_an_ollama_model_runs_in_place_with_its_go_template_and_params(home):
    models = store.default_store()
    defaults = model_defaults(models, "tinyzephyr")
    assert defaults.options["temperature"] == 0.5 and defaults.system == "You are a tiny zephyr."
    assert models.model_path("tinyzephyr").parent == home / ".ollama" / "models" / "blobs"  # no copy
    loaded = load_model(models.model_path("tinyzephyr")).with_template(defaults.chat_template("tinyzephyr"))
    messages = defaults.chat_messages([{"role": "user", "content": "Hi"}])
    text = "<|system|>\nYou are a tiny zephyr.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert loaded.chat_ids(messages) == loaded.tokenize(text)
    result = CliRunner().invoke(main, ["run", "tinyzephyr", "Hi", "--num-predict", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_corral_writes_into_the_ollama_store_in_place(home):
    root = home / ".ollama" / "models"
    blobs = sorted(p.name for p in (root / "blobs").iterdir())
    result = CliRunner().invoke(main, ["cp", "tinyzephyr", "me/zephyr:copy"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    copied = root / "manifests" / "registry.ollama.ai" / "me" / "zephyr" / "copy"
    assert (
        json.loads(copied.read_text())["layers"]
        == json.loads((root / "manifests/registry.ollama.ai/library/tinyzephyr/latest").read_text())["layers"]
    )
    assert sorted(p.name for p in (root / "blobs").iterdir()) == blobs  # the copy shares every blob
    assert not (home / ".corral").exists()


async def test_a_stored_template_corral_cannot_render_is_a_clear_400(tmp_path, nursery):
    root = write_ollama_store(
        tmp_path / "models", write_tiny_llama(tmp_path / "tiny.gguf"), "{{ range .Messages }}{{ upper .Content }}{{ end }}"
    )
    address = await nursery.start(serve, "127.0.0.1", 0, store.Store(root))
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as client:
        for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}), ("/api/generate", {"prompt": "hi"})):
            response = await client.post(path, json={"model": "tinyzephyr", "stream": False} | body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert 'function "upper" not defined' in error and "tinyzephyr" in error and str(tmp_path) not in error


def test_a_model_ollama_stored_in_mixed_case_is_found(home):
    """Ollama keeps names as typed (hf.co pulls are mixed case); corral's names are case-insensitive like Ollama's."""
    root = home / ".ollama" / "models" / "manifests"
    mixed = root / "hf.co" / "bartowski" / "Tiny-Zephyr-GGUF" / "Q4_K_M"
    mixed.parent.mkdir(parents=True)
    mixed.write_bytes((root / "registry.ollama.ai" / "library" / "tinyzephyr" / "latest").read_bytes())
    models = store.default_store()
    listed = [str(entry.name) for entry in models.list()]
    assert "hf.co/bartowski/tiny-zephyr-gguf:q4_k_m" in listed
    assert models.model_path("hf.co/bartowski/Tiny-Zephyr-GGUF:Q4_K_M") == models.model_path("tinyzephyr")
    assert model_defaults(models, listed[listed.index("hf.co/bartowski/tiny-zephyr-gguf:q4_k_m")]).template == ZEPHYR_GO
    models.delete("hf.co/bartowski/tiny-zephyr-gguf:q4_k_m")
    assert not mixed.exists() and models.manifest("tinyzephyr") is not None
