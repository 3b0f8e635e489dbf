"""Getting models from elsewhere and sending them back.

Ollama-style (OCI distribution) registries: `oci` speaks the registry protocol (manifests, blobs,
uploads, token auth), `download` fetches one blob in resumable ranged parts, `pull` and `push` move
whole models between a registry and a store. The Hugging Face Hub: `huggingface` (GGUF files of a
repository, through huggingface_hub), `gguf_split` (split GGUFs merged on pull).

Only the question the store asks of every name lives here, so that answering it imports no source's
client library (huggingface_hub takes a fifth of a second to import).
"""

from __future__ import annotations

# Ollama's hosts for GGUF files on the Hugging Face Hub.
HUB_HOSTS = ("hf.co", "huggingface.co")


def is_hub_name(name: object) -> bool:
    """Whether a model name points at the Hugging Face Hub (`hf.co/...` or `huggingface.co/...`)."""
    return str(name).split("/", 1)[0].lower() in HUB_HOSTS
