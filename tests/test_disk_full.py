"""A full disk during create or pull: a clear error, and the store exactly as it was (a small tmpfs as the disk)."""

import os
import subprocess

import pytest
from tiny_gguf import write_tiny_llama

from corral.errors import CorralError
from corral.modelfile import ModelSpec, create_model
from corral.store import Store, StoreFullError


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount; skipped where that is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def snapshot(root) -> dict:
    """Every file under `root` with its size."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def test_create_on_a_full_disk_is_a_clear_error_and_leaves_the_store_unchanged(small_disk, tmp_path):
    store = Store(small_disk / "models")
    small = write_tiny_llama(tmp_path / "small.gguf")
    assert os.path.getsize(small) < 512 * 1024
    create_model(store, "small:latest", ModelSpec(gguf_path=small))
    before = snapshot(store.root)
    big = write_tiny_llama(tmp_path / "big.gguf", embedding_length=256, feed_forward_length=512)
    assert os.path.getsize(big) > 1024 * 1024
    with pytest.raises(CorralError, match="disk holding the model store is full"):
        create_model(store, "big:latest", ModelSpec(gguf_path=big))
    assert snapshot(store.root) == before
    assert store.manifest("big:latest") is None and store.manifest("small:latest") is not None


def test_an_upload_on_a_full_disk_is_a_clear_error_and_leaves_no_partial_blob(small_disk):
    store = Store(small_disk / "models")
    with pytest.raises(StoreFullError, match="disk holding the model store is full") as raised:
        store.write_blob(os.urandom(2 << 20))
    assert str(small_disk) not in str(raised.value)
    assert snapshot(store.root) == {}
