"""The tiny vision models of vision_driver.py (Gemma 3) and llava_driver.py (LLaVA), built and converted once and cached (marker `peers`).

The driver's output is kept under CORRAL_PEERS (~/.cache/corral-peers/vision/<key>), keyed by the
driver's and its helpers' sources, the transformers version and llama.cpp's tree: a change to any of
them builds it anew (30-60 s on two busy cores), an unchanged one costs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import attrs
import numpy as np


@attrs.frozen
class VisionReference:
    """The driver's output: the text GGUF, the projector GGUF, the test image and transformers' numbers."""

    root: pathlib.Path

    @property
    def model(self) -> pathlib.Path:
        return self.root / "model.gguf"

    @property
    def projector(self) -> pathlib.Path:
        return self.root / "mmproj.gguf"

    @property
    def image(self) -> pathlib.Path:
        return self.root / "image.png"

    @property
    def hf(self) -> pathlib.Path:
        return self.root / "hf"

    def ids(self) -> dict[str, int]:
        """The special ids: bos, eos, boi_token_index, eoi_token_index, image_token_index."""
        return json.loads((self.root / "ids.json").read_text())

    def reference(self) -> dict[str, np.ndarray]:
        return dict(np.load(self.root / "reference.npz"))


HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ("vision_driver.py", "convert_driver.py", "reference_models.py")
DRIVERS = {"gemma3-vision": "vision_driver.py", "llava": "llava_driver.py"}  # family -> the driver that builds it


def cache_key(llama_cpp_dir: pathlib.Path, family: str = "gemma3-vision") -> str:
    """What the driver's output depends on: its sources, transformers' version, llama.cpp's tree."""
    digest = hashlib.sha256()
    for name in SOURCES + ((DRIVERS[family],) if DRIVERS[family] not in SOURCES else ()):
        digest.update((HERE / name).read_bytes())
    digest.update(importlib.metadata.version("transformers").encode())
    digest.update(str(pathlib.Path(llama_cpp_dir).resolve()).encode())
    return digest.hexdigest()[:16]


def cached(llama_cpp_dir: pathlib.Path, family: str = "gemma3-vision") -> VisionReference:
    """The family's driver output from the cache, built there first when it is missing."""
    import peers

    key = cache_key(llama_cpp_dir, family)
    root = peers.cache_dir() / "vision" / (key if family == "gemma3-vision" else f"{family}-{key}")
    if not (root / family / "mmproj.gguf").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
            build(llama_cpp_dir, pathlib.Path(scratch), family)
            shutil.rmtree(root, ignore_errors=True)
            os.replace(scratch, root)  # whole or not at all: an interrupted build leaves no half folder
            os.mkdir(scratch)  # for TemporaryDirectory's cleanup
    return VisionReference(root / family)


def build(llama_cpp_dir: pathlib.Path, out: pathlib.Path, family: str = "gemma3-vision") -> VisionReference:
    """Run the family's driver into `out`; RuntimeError with the driver's traceback where it failed."""
    driver = HERE / DRIVERS[family]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(driver), str(llama_cpp_dir), str(out)], capture_output=True, text=True, timeout=600, env=env)
    root = out / family
    if done.returncode != 0 or (root / "error.txt").is_file() or not (root / "mmproj.gguf").is_file():
        error = (root / "error.txt").read_text() if (root / "error.txt").is_file() else ""
        raise RuntimeError(f"{driver.name} failed ({done.returncode}):\n{error}\n{done.stdout}\n{done.stderr}")
    return VisionReference(root)
