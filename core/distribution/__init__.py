"""Getting models from elsewhere and sending them back: Ollama-style (OCI distribution) registries.

`oci` speaks the registry protocol (manifests, blobs, uploads, token auth), `download` fetches one
blob in resumable ranged parts, `pull` and `push` move whole models between a registry and a store.
"""
