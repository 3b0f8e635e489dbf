"""`hf.co/<user>/<repo>[:<quant>]` pulls through huggingface_hub, against a local server answering the Hub's endpoints.

The repositories hold tiny synthetic GGUFs (tests/tiny_gguf.py); HF_ENDPOINT points at the server and
HF_HUB_CACHE at a temporary folder in every test, so the real Hub and the user's cache are never touched.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import gguf
import httpx
import ollama
import pytest
import trio
from hub_server import HubServer
from huggingface_hub import constants
from PIL import Image
from tiny_gguf import Q, write_tiny_gemma3, write_tiny_gemma3_projector, write_tiny_llama

from corral.distribution import huggingface
from corral.distribution.huggingface import HubOfflineError, HubRepoNotFoundError, NoGGUFError, QuantNotFoundError, RepoFile
from corral.errors import InvalidModelNameError
from corral.gguf import GGUFFile
from corral.runner.runtime import Runtime
from corral.store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, DigestMismatchError, Store, ensure_model

GREEDY = {"temperature": 0, "num_predict": 6}
PROJECTOR_TYPES = {"F16.gguf": Q.F16, "Q8_0.gguf": Q.Q8_0}  # a projector file's name ending -> its matrices' type
TOKEN = "hf_test_secret_token_0123456789"


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def write_split(source: str, first_part: Path, tensors_per_part: int) -> list[Path]:
    """`source` rewritten by gguf-py's split writer as `<stem>-0000i-of-0000N.gguf` files (llama.cpp's layout)."""
    reader = gguf.GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(os.fspath(first_part), architecture, split_max_tensors=tensors_per_part)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = gguf.GGUFValueType(field.types[0])
        writer.add_key_value(key, field.contents(), main, gguf.GGUFValueType(field.types[-1]) if main == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(first_part.parent.glob(f"{first_part.stem}-*-of-*.gguf"))


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """The repositories the local Hub serves (files of different seeds, so each has its own bytes)."""
    root = tmp_path_factory.mktemp("hub")

    def repo(repo_id: str, *names: str, writer=write_tiny_llama) -> Path:
        folder = root / repo_id
        folder.mkdir(parents=True)
        for seed, name in enumerate(names):
            if "mmproj" in name:
                write_tiny_gemma3_projector(folder / name, matrix_type=PROJECTOR_TYPES[name.rsplit("-", 1)[-1]], seed=seed,
                                            projector_type="qwen2vl" if "Unknown" in name else "gemma3")  # fmt: skip
            elif name.endswith(".gguf"):
                writer(folder / name, seed=seed)
            else:
                (folder / name).write_text(f"{name} of {repo_id}\n")
        return folder

    repo("tiny/Tiny-GGUF", "README.md", "Tiny-F16.gguf", "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "imatrix-Tiny-F16.gguf")
    vision = ("Vision-F16.gguf", "Vision-Q4_K_M.gguf", "mmproj-Vision-F16.gguf", "mmproj-Vision-Q8_0.gguf")
    repo("tiny/Vision-GGUF", *vision, writer=write_tiny_gemma3)
    repo("tiny/LyingVision-GGUF", *vision, writer=write_tiny_gemma3)
    repo("tiny/HostileVision-GGUF", *vision, writer=write_tiny_gemma3)
    repo("tiny/UnknownVision-GGUF", "UnknownVision-Q4_K_M.gguf", "mmproj-UnknownVision-F16.gguf", writer=write_tiny_gemma3)
    repo("tiny/NoDefault-GGUF", "nodefault-f16.gguf", "nodefault-q2_k.gguf", "nodefault-q8_0.gguf")
    repo("tiny/Only-GGUF", "only.IQ3_M.gguf")
    repo("tiny/No-GGUF", "README.md", "model.safetensors")
    repo("tiny/Private-GGUF", "Private-Q4_K_M.gguf")
    repo("tiny/Hostile-GGUF", "Hostile-Q8_0.gguf")
    repo("tiny/Lying-GGUF", "Lying-Q8_0.gguf")
    repo("tiny/Gated-GGUF", "Gated-Q4_K_M.gguf")
    repo("tiny/Flaky-GGUF", "Flaky-Q4_K_M.gguf")
    repo("tiny/BadSplit-GGUF", "Bad-Q4_K_M-00001-of-00002.gguf", "Bad-Q4_K_M-00002-of-00002.gguf")  # whole files, not parts
    split = repo("tiny/Split-GGUF", "README.md")
    whole = write_tiny_llama(root / "split-source.gguf", seed=7)
    parts = write_split(whole, split / "Split-Q4_K_M.gguf", tensors_per_part=8)
    assert len(parts) == 3, parts
    return root


def hostile_info(info: dict) -> None:
    """Names that would climb out of a folder, and an LFS sha256 that is not one."""
    (sibling,) = info["siblings"]
    sibling["lfs"]["sha256"] = "../../../etc/passwd"
    for name in ("../../escape-Q4_K_M.gguf", "/abs-Q4_K_M.gguf", "a\\..\\b-Q4_K_M.gguf", "sub//x-Q4_K_M.gguf", "../mmproj-escape-F16.gguf"):
        info["siblings"].append({"rfilename": name, "size": 1, "lfs": {"sha256": "0" * 64, "size": 1, "pointerSize": 134}})


def lying_info(info: dict) -> None:
    """A well-formed LFS sha256 that the file's bytes do not have."""
    info["siblings"][0]["lfs"]["sha256"] = "ab" * 32


def hostile_projector_info(info: dict) -> None:
    """The projector's LFS sha256 a path, and a projector whose name climbs out of the repo (nearer the model's quant)."""
    (projector,) = [sibling for sibling in info["siblings"] if sibling["rfilename"] == "mmproj-Vision-Q8_0.gguf"]
    projector["lfs"]["sha256"] = "../../blobs/sha256-" + "0" * 64
    info["siblings"].append({"rfilename": "../mmproj-Vision-Q4_0.gguf", "size": 1, "lfs": {"sha256": "1" * 64, "size": 1, "pointerSize": 134}})


def lying_projector_info(info: dict) -> None:
    """The model's sha256 true, the projector's not."""
    (projector,) = [sibling for sibling in info["siblings"] if sibling["rfilename"] == "mmproj-Vision-Q8_0.gguf"]
    projector["lfs"]["sha256"] = "cd" * 32


@pytest.fixture
def hub(hub_root, tmp_path, monkeypatch):
    """The local Hub, with HF_ENDPOINT at it and an empty HF cache of the test's own."""
    tamper = {"tiny/Hostile-GGUF": hostile_info, "tiny/Lying-GGUF": lying_info, "tiny/LyingVision-GGUF": lying_projector_info,
              "tiny/HostileVision-GGUF": hostile_projector_info}
    gated, flaky = frozenset({"tiny/Gated-GGUF"}), frozenset({"tiny/Flaky-GGUF/Flaky-Q4_K_M.gguf"})
    with HubServer(hub_root, private={"tiny/Private-GGUF": TOKEN}, tamper=tamper, gated=gated, interrupt_once=flaky) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of the developer's
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield server


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "models")


def contents(store: Store) -> set[Path]:
    """Every file of the store, so a failed pull can be shown to leave it as it was."""
    return {path.relative_to(store.root) for path in store.root.rglob("*")} if store.root.exists() else set()


# ---- choosing the file -------------------------------------------------------------------------------


def test_the_default_quant_is_q4_k_m(hub, hub_root, store):
    events = []
    store.pull("hf.co/tiny/Tiny-GGUF", progress=events.append)
    expected = hub_root / "tiny/Tiny-GGUF/Tiny-Q4_K_M.gguf"
    assert store.model_path("hf.co/tiny/tiny-gguf:latest").read_bytes() == expected.read_bytes()
    assert [str(entry.name) for entry in store.list()] == ["hf.co/tiny/tiny-gguf:latest"]
    digest = sha256(expected)
    layer_events = [event for event in events if event.get("digest") == digest]
    assert layer_events and layer_events[0]["status"] == f"pulling {digest[7:19]}"
    assert layer_events[-1]["completed"] == layer_events[-1]["total"] == expected.stat().st_size
    assert events[0] == {"status": "pulling manifest"} and events[-1] == {"status": "success"}


@pytest.mark.parametrize(
    ("tag", "file"),
    [("Q8_0", "Tiny-Q8_0.gguf"), ("q8_0", "Tiny-Q8_0.gguf"), ("f16", "Tiny-F16.gguf"), ("Tiny-F16.gguf", "Tiny-F16.gguf")],
)
def test_a_quant_tag_picks_its_file_case_insensitively(hub, hub_root, store, tag, file):
    store.pull(f"huggingface.co/tiny/Tiny-GGUF:{tag}")
    assert store.model_path(f"huggingface.co/tiny/tiny-gguf:{tag}").read_bytes() == (hub_root / "tiny/Tiny-GGUF" / file).read_bytes()


@pytest.mark.parametrize(("repo", "file"), [("NoDefault-GGUF", "nodefault-q8_0.gguf"), ("Only-GGUF", "only.IQ3_M.gguf")])
def test_without_q4_k_m_the_default_falls_back_to_q8_0_then_the_first_gguf(hub, hub_root, store, repo, file):
    store.pull(f"hf.co/tiny/{repo}")
    assert store.model_path(f"hf.co/tiny/{repo}").read_bytes() == (hub_root / "tiny" / repo / file).read_bytes()


def test_choosing_skips_projectors_and_takes_every_split_part():
    files = [RepoFile("mmproj-x-Q4_K_M.gguf"), RepoFile("sub/x-Q4_K_M-00002-of-00002.gguf"), RepoFile("sub/x-Q4_K_M-00001-of-00002.gguf")]
    chosen = huggingface.choose_files(files, None, "u/r")
    assert [file.path for file in chosen] == ["sub/x-Q4_K_M-00001-of-00002.gguf", "sub/x-Q4_K_M-00002-of-00002.gguf"]
    with pytest.raises(NoGGUFError, match=r"lacks part\(s\) \[2\]"):
        huggingface.choose_files(files[:1] + files[2:], "q4_k_m", "u/r")
    with pytest.raises(NoGGUFError, match="no GGUF model file"):
        huggingface.choose_files(files[:1], None, "u/r")


# ---- vision projectors -----------------------------------------------------------------------------------


def test_choosing_a_projector_follows_llama_cpps_rule():
    files = [RepoFile(p) for p in ("mmproj-BF16.gguf", "mmproj-Q8_0.gguf", "mmproj-F32.gguf", "sub/mmproj-F16.gguf", "other/mmproj-Q4_0.gguf",
                                   "mmproj-Q4_0-00001-of-00002.gguf", "x-Q4_K_M.gguf", "sub/x-Q4_K_M.gguf", "mmproj-f16.gguf")]  # fmt: skip

    def chosen(model: str, among=files) -> str | None:
        projector = huggingface.choose_projector(among, RepoFile(model))
        return projector and projector.path

    assert chosen("x-Q4_K_M.gguf") == "mmproj-Q8_0.gguf"  # the bits nearest 4 (a split projector is never taken)
    assert chosen("x-F16.gguf") == "mmproj-BF16.gguf"  # 16 bits twice: the first in path order
    assert chosen("x-F32.gguf") == "mmproj-F32.gguf"
    assert chosen("sub/x-Q4_K_M.gguf") == "sub/mmproj-F16.gguf"  # the model's own folder before a parent
    assert chosen("x-Q4_K_M.gguf", files[3:5]) is None  # only in folders below or beside the model's
    assert chosen("x-Q4_K_M.gguf", files[6:8]) is None


@pytest.mark.parametrize(("tag", "projector"), [(None, "mmproj-Vision-Q8_0.gguf"), ("F16", "mmproj-Vision-F16.gguf")])
def test_a_repo_with_projectors_gives_the_model_the_one_nearest_its_quant(hub, hub_root, store, tag, projector):
    name = "hf.co/tiny/Vision-GGUF" + (f":{tag}" if tag else "")
    events = []
    manifest = store.pull(name, progress=events.append)
    expected = hub_root / "tiny/Vision-GGUF" / projector
    assert store.projector_path(name).read_bytes() == expected.read_bytes()
    assert [layer.media_type for layer in manifest.layers] == [MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE]
    assert any(event.get("digest") == sha256(expected) and event["completed"] == event["total"] for event in events)
    assert hub.downloads() == 2


def test_offline_the_cached_projector_comes_with_the_model(hub, tmp_path, store, monkeypatch):
    store.pull("hf.co/tiny/Vision-GGUF")
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    other = Store(tmp_path / "other-models")
    other.pull("hf.co/tiny/Vision-GGUF")
    assert hub.requests == []
    assert other.projector_path("hf.co/tiny/Vision-GGUF").read_bytes() == store.projector_path("hf.co/tiny/Vision-GGUF").read_bytes()


def test_a_projector_no_encoder_reads_is_left_out_with_a_warning(hub, store, caplog):
    manifest = store.pull("hf.co/tiny/UnknownVision-GGUF")
    assert [layer.media_type for layer in manifest.layers] == [MODEL_MEDIA_TYPE]
    assert "leaving out the projector tiny/UnknownVision-GGUF/mmproj-UnknownVision-F16.gguf" in caplog.text and "'qwen2vl'" in caplog.text
    assert {"sha256:" + path.name.removeprefix("sha256-") for path in store.blobs_dir.iterdir()} == manifest.blobs  # its blob went again


def test_a_projectors_hostile_name_and_digest_from_the_hub_never_become_paths(hub, hub_root, store, caplog):
    store.pull("hf.co/tiny/HostileVision-GGUF")
    expected = hub_root / "tiny/HostileVision-GGUF/mmproj-Vision-Q8_0.gguf"
    pulled = store.projector_path("hf.co/tiny/HostileVision-GGUF")
    assert pulled.read_bytes() == expected.read_bytes() and pulled.name == "sha256-" + sha256(expected)[7:]
    assert not any("Q4_0" in path for _, path in hub.requests) and "unsafe name" in caplog.text


def test_a_projector_that_fails_its_sha256_leaves_the_store_as_it_was(hub, store):
    store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    before = contents(store)
    with pytest.raises(DigestMismatchError, match="the Hub announced sha256:cdcd"):
        store.pull("hf.co/tiny/LyingVision-GGUF")
    assert contents(store) == before  # the model's blob, in the store a moment, went with it


@pytest.mark.slow
async def test_a_pulled_vision_model_answers_an_image_over_the_api_and_shows_vision(hub, tmp_path, nursery, monkeypatch):
    from conftest import _serve

    monkeypatch.setenv("CORRAL_RUNNER", "inprocess")
    url = await _serve(tmp_path / "served-models", nursery)
    client = ollama.Client(host=url)
    await trio.to_thread.run_sync(client.pull, "hf.co/tiny/Vision-GGUF")
    shown = await trio.to_thread.run_sync(client.show, "hf.co/tiny/Vision-GGUF")
    assert "vision" in shown.capabilities
    image = io.BytesIO()
    Image.new("RGB", (20, 12), (200, 40, 90)).save(image, "PNG")
    options = {"temperature": 0, "num_predict": 2, "num_ctx": 128}
    answers = [
        await trio.to_thread.run_sync(lambda images=images: client.generate("hf.co/tiny/Vision-GGUF", "look", images=images, options=options, raw=True))
        for images in ([image.getvalue()], [])
    ]
    with_image, without = (answer.prompt_eval_count for answer in answers)
    assert with_image >= without + 4  # the projector's 4 embeddings (and their markers) joined the prompt


# ---- split GGUFs ----------------------------------------------------------------------------------------


async def test_a_split_gguf_is_merged_into_one_blob_that_loads_and_answers(hub, hub_root, store):
    await trio.to_thread.run_sync(store.pull, "hf.co/tiny/Split-GGUF:Q4_K_M")
    merged, original = GGUFFile.open(store.model_path("hf.co/tiny/split-gguf:q4_k_m")), GGUFFile.open(hub_root / "split-source.gguf")
    assert hub.downloads() == 3
    assert {key: value for key, value in merged.metadata.items() if not key.startswith("split.")} == original.metadata
    assert not any(key.startswith("split.") for key in merged.metadata)
    assert list(merged.tensors) == list(original.tensors)
    for name in original.tensors:
        assert (merged.raw(name) == original.raw(name)).all(), name
    answers = []
    for path in (merged.path, original.path):
        async with Runtime.open(str(path), num_parallel=1, num_ctx=64, num_batch=16) as runtime:
            async with runtime.generate("hello world", GREEDY, raw=True) as stream:
                answers.append(await stream.collect())
    (text, final), (expected_text, _) = answers
    assert final.eval_count == GREEDY["num_predict"] and text == expected_text


def test_a_download_broken_off_halfway_resumes_with_a_range_request(hub, hub_root, store, monkeypatch):
    # huggingface_hub writes (and resumes from) whole 10 MB chunks; the tiny file needs smaller ones.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)
    events = []
    store.pull("hf.co/tiny/Flaky-GGUF", progress=events.append)
    expected = hub_root / "tiny/Flaky-GGUF/Flaky-Q4_K_M.gguf"
    size = expected.stat().st_size
    assert store.model_path("hf.co/tiny/flaky-gguf").read_bytes() == expected.read_bytes()
    assert hub.downloads() == 2 and hub.ranges[-1] == f"bytes={size // 2 // (1 << 14) * (1 << 14)}-"
    completed = [event["completed"] for event in events if "completed" in event]
    assert completed == sorted(completed) and completed[-1] == size  # one bar, never past the total


# ---- the HF cache ---------------------------------------------------------------------------------------


def test_a_second_pull_reuses_the_hf_cache_and_the_store_blob_is_a_hard_link_to_it(hub, tmp_path, store):
    store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    other = Store(tmp_path / "other-models")
    other.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    assert hub.downloads() == 1
    cached = next((tmp_path / "hf-cache").glob("models--tiny--Tiny-GGUF/snapshots/*/Tiny-Q8_0.gguf")).resolve()
    for pulled in (store, other):
        assert os.path.samefile(pulled.model_path("hf.co/tiny/tiny-gguf:q8_0"), cached)


def test_a_cache_on_another_filesystem_is_copied_and_verified(hub, tmp_path, store, monkeypatch):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than the test's temporary folder")
    cache = Path(tempfile.mkdtemp(dir=shm, prefix="corral-hf-cache-"))
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
        cached = next(cache.glob("models--tiny--Tiny-GGUF/snapshots/*/Tiny-Q8_0.gguf")).resolve()
        pulled = store.model_path("hf.co/tiny/tiny-gguf:q8_0")
        assert not os.path.samefile(pulled, cached) and pulled.read_bytes() == cached.read_bytes()
    finally:
        shutil.rmtree(cache)


def test_a_damaged_cache_copy_is_downloaded_again(hub, tmp_path, store):
    store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    cached = next((tmp_path / "hf-cache").glob("models--tiny--Tiny-GGUF/snapshots/*/Tiny-Q8_0.gguf")).resolve()
    good = cached.read_bytes()
    with open(cached, "r+b") as file:  # damage the cache in place (the first store shares its bytes and is dropped)
        file.write(b"XXXX")
    other = Store(tmp_path / "other-models")
    other.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    assert hub.downloads() == 2
    assert other.model_path("hf.co/tiny/tiny-gguf:q8_0").read_bytes() == good


def test_offline_with_a_warm_cache_pulls_without_asking_the_hub(hub, hub_root, tmp_path, store, monkeypatch):
    store.pull("hf.co/tiny/Tiny-GGUF")
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    other = Store(tmp_path / "other-models")
    other.pull("hf.co/tiny/Tiny-GGUF")
    assert hub.requests == []
    assert other.model_path("hf.co/tiny/tiny-gguf").read_bytes() == (hub_root / "tiny/Tiny-GGUF/Tiny-Q4_K_M.gguf").read_bytes()


def test_offline_a_quant_not_in_the_cache_names_what_the_cache_has(hub, store, monkeypatch):
    store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = r"cache's copy of tiny/Tiny-GGUF \(HF_HUB_OFFLINE is set\) has no GGUF for quant 'F16'; available: Q8_0$"
    with pytest.raises(QuantNotFoundError, match=message):
        store.pull("hf.co/tiny/Tiny-GGUF:F16")


def test_offline_a_cached_split_gguf_is_merged_again(hub, hub_root, tmp_path, store, monkeypatch):
    store.pull("hf.co/tiny/Split-GGUF")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    other = Store(tmp_path / "other-models")
    other.pull("hf.co/tiny/Split-GGUF:q4_k_m")
    assert other.model_path("hf.co/tiny/split-gguf:q4_k_m").read_bytes() == store.model_path("hf.co/tiny/split-gguf").read_bytes()


# ---- errors leave the store as it was -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("hf.co/tiny/Missing-GGUF", HubRepoNotFoundError, "no Hugging Face repository tiny/Missing-GGUF"),
        ("hf.co/tiny/No-GGUF", NoGGUFError, "has no GGUF model file"),
        ("hf.co/tiny/Tiny-GGUF:Q5_K_S", QuantNotFoundError, r"no GGUF for quant 'Q5_K_S'; available: F16, Q4_K_M, Q8_0$"),
        ("hf.co/tiny/Private-GGUF", HubRepoNotFoundError, "set HF_TOKEN"),
        ("hf.co/tiny", InvalidModelNameError, "use hf.co/<user>/<repo>"),
        ("hf.co/tiny/Gated-GGUF", HubRepoNotFoundError, "tiny/Gated-GGUF is gated: accept its terms on the Hub and set HF_TOKEN"),
        ("hf.co/tiny/BadSplit-GGUF", huggingface.HubPullError, "cannot be merged: Bad-Q4_K_M-00001-of-00002.gguf is not part of a split"),
    ],
)
def test_errors_are_clear_and_leave_the_store_as_it_was(hub, store, name, error, message):
    store.pull("hf.co/tiny/Tiny-GGUF:Q8_0")
    before = contents(store)
    with pytest.raises(error, match=message):
        store.pull(name)
    assert contents(store) == before


def test_hostile_file_names_and_digests_from_the_hub_never_become_paths(hub, hub_root, store, caplog):
    store.pull("hf.co/tiny/Hostile-GGUF")  # the Q4_K_M names are unsafe and skipped: the Q8_0 is the default
    expected = hub_root / "tiny/Hostile-GGUF/Hostile-Q8_0.gguf"
    pulled = store.model_path("hf.co/tiny/hostile-gguf")
    assert pulled.read_bytes() == expected.read_bytes() and pulled.name == "sha256-" + sha256(expected)[7:]
    assert not any("escape" in path for _, path in hub.requests)
    assert "unsafe name" in caplog.text


def test_bytes_that_do_not_match_the_hubs_sha256_never_enter_the_store(hub, store):
    with pytest.raises(DigestMismatchError, match="the Hub announced sha256:abab"):
        store.pull("hf.co/tiny/Lying-GGUF")
    assert hub.downloads() == 2  # the cached copy is fetched once more before giving up
    assert not list(store.blobs_dir.iterdir())  # neither the blob nor a partial file


def test_offline_with_a_cold_cache_says_so_without_asking_the_hub(hub, store, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of tiny/Tiny-GGUF"):
        store.pull("hf.co/tiny/Tiny-GGUF")
    assert hub.requests == [] and contents(store) == set()


def test_an_unreachable_hub_is_a_pull_error(hub, store, monkeypatch):
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{sock.getsockname()[1]}")
    with pytest.raises(huggingface.HubPullError, match="cannot reach the Hugging Face Hub for tiny/Tiny-GGUF"):
        store.pull("hf.co/tiny/Tiny-GGUF")
    assert contents(store) == set()


def test_hf_token_reads_a_private_repo_and_is_never_logged(hub, hub_root, store, monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    events = []
    with caplog.at_level(logging.DEBUG):
        store.pull("hf.co/tiny/Private-GGUF", progress=events.append)
    assert store.model_path("hf.co/tiny/private-gguf").read_bytes() == (hub_root / "tiny/Private-GGUF/Private-Q4_K_M.gguf").read_bytes()
    assert f"Bearer {TOKEN}" in hub.authorizations
    assert TOKEN not in caplog.text and TOKEN not in repr(events)


def test_ensure_model_pulls_a_hub_name_whose_tag_is_a_file_name(hub, hub_root, tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "default-models"))
    path = ensure_model("hf.co/tiny/Tiny-GGUF:Tiny-F16.gguf")
    assert path.read_bytes() == (hub_root / "tiny/Tiny-GGUF/Tiny-F16.gguf").read_bytes()


# ---- through the server and the CLI ---------------------------------------------------------------------


async def test_api_pull_with_the_ollama_client_streams_progress_and_lists_the_model(hub, hub_root, tmp_path, nursery):
    from conftest import _serve

    url = await _serve(tmp_path / "served-models", nursery)
    client = ollama.Client(host=url)
    events = await trio.to_thread.run_sync(lambda: list(client.pull("hf.co/tiny/Tiny-GGUF:Q8_0", stream=True)))
    digest = sha256(hub_root / "tiny/Tiny-GGUF/Tiny-Q8_0.gguf")
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    assert any(event.digest == digest and event.completed == event.total for event in events)
    names = [model.model for model in (await trio.to_thread.run_sync(client.list)).models]
    assert names == ["hf.co/tiny/tiny-gguf:q8_0"]
    with pytest.raises(ollama.ResponseError, match="no Hugging Face repository tiny/Missing-GGUF"):
        await trio.to_thread.run_sync(lambda: list(client.pull("hf.co/tiny/Missing-GGUF", stream=True)))
    with pytest.raises(ollama.ResponseError, match="no Hugging Face repository") as missing:
        await trio.to_thread.run_sync(client.pull, "hf.co/tiny/Missing-GGUF")
    assert missing.value.status_code == 404


async def test_api_pull_errors_are_4xx(hub, tmp_path, nursery):
    from conftest import _serve

    url = await _serve(tmp_path / "served-models", nursery)
    async with httpx.AsyncClient(base_url=url) as http:
        missing = await http.post("/api/pull", json={"model": "hf.co/tiny/Missing-GGUF", "stream": False})
        quant = await http.post("/api/pull", json={"model": "hf.co/tiny/Tiny-GGUF:Q3_K_S", "stream": False})
        empty = await http.post("/api/pull", json={"model": "hf.co/tiny/No-GGUF", "stream": False})
    assert missing.status_code == 404 and "no Hugging Face repository" in missing.json()["error"]
    assert quant.status_code == 404 and "available: F16, Q4_K_M, Q8_0" in quant.json()["error"]
    assert empty.status_code == 400 and "no GGUF model file" in empty.json()["error"]


def test_corral_pull_on_the_command_line(hub, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from corral.cli import main

    with socket.socket() as sock:  # nothing listens there, so the CLI pulls in-process
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "cli-models"))
    result = CliRunner().invoke(main, ["pull", "hf.co/tiny/Tiny-GGUF"])
    assert result.exit_code == 0, result.output
    assert "success" in result.output
    listed = CliRunner().invoke(main, ["list"])
    assert "hf.co/tiny/tiny-gguf:latest" in listed.output
