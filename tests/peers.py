"""The reference projects the suite checks against (see ../shared/peers.md): llama.cpp's sources.

llama.cpp's converter (`convert_hf_to_gguf.py`), its tokenizer suite (`models/ggml-vocab-*.gguf`
with `.inp`/`.out`) and its chat templates come from the llama-cpp-python sdist on PyPI, fetched
once with pip and unpacked into a cache directory outside the repository (CORRAL_PEERS, default
~/.cache/corral-peers). Nothing of it is committed. A test needing it asks for `llama_cpp_dir`
(conftest.py), which marks it `peers`.

The suite runs in several pytest-xdist workers at once, so each cache entry is filled under a file
lock (`cache_lock`): one worker downloads or builds it, the others wait and then read it.
"""

from __future__ import annotations

import os
import shutil
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import filelock

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST_DIR = "llama_cpp_python-0.3.36"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CORRAL_PEERS") or pathlib.Path.home() / ".cache" / "corral-peers")


def cache_lock(name: str) -> filelock.FileLock:
    """The lock one cache entry is filled under, shared by every process on this machine."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(root / f".{name}.lock")


def llama_cpp_sources() -> pathlib.Path:
    """The vendored llama.cpp tree of the llama-cpp-python sdist, downloaded and unpacked on first use."""
    with cache_lock(SDIST_DIR):
        return _llama_cpp_sources()


def _llama_cpp_sources() -> pathlib.Path:
    root = cache_dir()
    tree = root / SDIST_DIR / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    with tempfile.TemporaryDirectory(dir=root) as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", download, LLAMA_CPP_PYTHON],
            check=True,
        )
        (sdist,) = pathlib.Path(download).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(download, filter="data")
        # Unpacked beside the cache, then moved in whole: an interrupted run leaves no half tree.
        shutil.rmtree(root / SDIST_DIR, ignore_errors=True)
        os.replace(pathlib.Path(download) / SDIST_DIR, root / SDIST_DIR)
    return tree
