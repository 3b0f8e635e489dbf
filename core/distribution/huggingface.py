"""Pull GGUF models from the Hugging Face Hub: `hf.co/<user>/<repo>[:<quant>]`, Ollama's syntax.

Everything that talks to the Hub goes through `huggingface_hub`, so HF_ENDPOINT, HF_TOKEN,
HF_HUB_OFFLINE and its cache (HF_HUB_CACHE) behave as for any Hugging Face tool; they are read at each
pull, so a running server follows the environment it was started with and a test can set them.

Choosing the file. Ollama leaves the choice to the Hub, whose documentation says only "Q4_K_M when
the repo has it, else one reasonable quant present in the repo". corral follows the rule llama.cpp's
`-hf` client publishes in code: the tag's quant (case-insensitive) or the tag as a file name; without
a tag, Q4_K_M, then Q8_0, then the repo's first model GGUF. Projector and imatrix files never count
as models. The store name keeps the host and the tag as typed (`hf.co/user/repo:q4_k_m`, `:latest`
without a tag), as `ollama list` shows them.

Vision projectors. A repo that ships an `mmproj` GGUF beside the model gets it pulled too and stored as
the model's projector layer (Ollama's media type), as Ollama's pull of such a repo gives one, so the
model answers with images. Of several (`mmproj-F16`, `mmproj-Q8_0`, ...) the one llama.cpp's `-hf`
picks: in the model's folder or one above it (the deepest such folder first), then the quant whose bit
count is nearest the model's (Q4_K_M: Q8_0 before F16; an F16 model: F16), the first in path order on
a tie. A projector no installed vision encoder reads, or one beside a text model that takes no images,
is left out with a warning: the text model still works, and claims no vision it does not have.

Into the store without copying twice: the file lands in the HF cache, and its cache blob is hard
linked under the store's sha256 name; only across filesystems is it copied (hashed while copying).
The Hub announces an LFS file's sha256, which is checked against the bytes once, when the blob enters
the store; a blob already in the store under that digest was verified then, so it is not hashed again.

Split GGUFs are merged into one blob on pull (core/distribution/gguf_split.py) rather than taught to
the loader: one model layer stays one GGUF, so the loader, the runner process, /api/show, push and an
Ollama store reading corral's all work unchanged. The price is one copy of the bytes for split models.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import huggingface_hub
from huggingface_hub import errors as hub_errors

from corral.distribution.gguf_split import merge_split
from corral.errors import CorralError, GGUFError, InvalidModelNameError, ModelNotFoundError, UnknownArchitectureError
from corral.gguf import GGUFFile
from corral.store import (
    MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, DigestMismatchError, Manifest, ModelName, Progress, PullError, Store, StoreFullError,
    is_full_disk, parse_name,
)

log = logging.getLogger(__name__)

# llama.cpp's `-hf` order when no quant is named; after these, the repo's first model GGUF.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# Files that are GGUF but not a model to run on their own.
_NOT_MODELS = ("mmproj", "imatrix")
# A repo path the Hub may name: relative, no `..` or empty components, no backslashes.
_REPO_PATH = re.compile(r"(?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+\.gguf", re.IGNORECASE)
_SPLIT = re.compile(r"(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)
_QUANT = re.compile(r"[-.]([A-Za-z0-9_]+)$")
_BITS = re.compile(r"\d+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class HubRepoNotFoundError(ModelNotFoundError):
    """The Hub has no such repository, or it is private or gated and the token cannot read it."""


class QuantNotFoundError(ModelNotFoundError):
    """The repository has no GGUF of the requested quant."""


class NoGGUFError(CorralError):
    """The repository holds no GGUF model file."""


class HubOfflineError(ModelNotFoundError):
    """HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of the repository."""


class HubPullError(PullError):
    """The Hub could not be reached or answered an error."""


class HubCacheFullError(StoreFullError):
    """The disk holding the Hugging Face cache ran out of space while a file was downloaded into it (a 507, as the store's)."""


@attrs.frozen
class HubReference:
    """A parsed `hf.co/<user>/<repo>[:<tag>]`: the repo id as the Hub spells it, the tag, the store name."""

    repo_id: str
    tag: str | None
    name: ModelName


@attrs.frozen
class RepoFile:
    """One GGUF file in a repository: its path, and size and sha256 when the Hub or cache tells them."""

    path: str
    size: int | None = None
    sha256: str | None = None

    @property
    def split(self) -> tuple[str, int, int] | None:
        """(prefix, part number, part count) of a `-0000i-of-0000N.gguf` part, else None."""
        match = _SPLIT.fullmatch(self.path)
        return (match["prefix"], int(match["index"]), int(match["count"])) if match else None

    @property
    def quant(self) -> str:
        """The quant the file name ends with (`...-Q4_K_M.gguf` -> Q4_K_M), upper-cased; '' if none."""
        split = self.split
        stem = split[0] if split else self.path[: -len(".gguf")]
        match = _QUANT.search(stem.rsplit("/", 1)[-1])
        return match[1].upper() if match else ""

    @property
    def is_model(self) -> bool:
        name = self.path.rsplit("/", 1)[-1].lower()
        return not any(word in name for word in _NOT_MODELS)

    @property
    def is_projector(self) -> bool:
        """A vision projector (`mmproj` in the file name) in one file: split projectors are not taken."""
        return "mmproj" in self.path.rsplit("/", 1)[-1].lower() and self.split is None

    @property
    def bits(self) -> int:
        """The quant's bit count, as llama.cpp reads it: the first number in the quant (Q4_K_M 4, F16 16); 0 without one."""
        match = _BITS.search(self.quant)
        return int(match[0]) if match else 0


def parse_reference(name: str | ModelName) -> HubReference:
    """Split `hf.co/<user>/<repo>[:<tag>]`; validated as any store name, the case kept for the Hub."""
    text = str(name)
    model_name = parse_name(text)
    rest, tag = text, ""
    colon = text.rfind(":")
    if colon > text.rfind("/"):
        rest, tag = text[:colon], text[colon + 1 :]
    parts = rest.split("/")
    if len(parts) != 3:
        raise InvalidModelNameError(f"invalid Hugging Face model name {text!r}: use hf.co/<user>/<repo>[:<quant>]")
    return HubReference(f"{parts[1]}/{parts[2]}", tag if tag.lower() not in ("", "latest") else None, model_name)


def choose_files(files: Iterable[RepoFile], tag: str | None, repo_id: str, offline: bool = False) -> list[RepoFile]:
    """The file (or every part of the split set) the tag names, by the rule in the module docstring.

    Offline, `files` are those of the cached snapshot, as llama.cpp does: the choice is among what is there.
    """
    where = f"the Hugging Face cache's copy of {repo_id} (HF_HUB_OFFLINE is set)" if offline else f"the Hugging Face repository {repo_id}"
    models = sorted((file for file in files if file.is_model), key=lambda file: file.path)
    if not models:
        raise NoGGUFError(f"{where} has no GGUF model file")
    firsts = [file for file in models if file.split is None or file.split[1] == 1]
    if tag is not None:
        by_name = [file for file in firsts if tag.lower() in (file.path.lower(), file.path.rsplit("/", 1)[-1].lower())]
        chosen = by_name or [file for file in firsts if file.quant == tag.upper()]
        if not chosen:
            raise QuantNotFoundError(f"{where} has no GGUF for quant {tag!r}; available: {_quants(firsts)}")
    else:
        chosen = [file for quant in DEFAULT_QUANTS for file in firsts if file.quant == quant] or firsts
    return _split_set(chosen[0], models)


def choose_projector(files: Iterable[RepoFile], model: RepoFile) -> RepoFile | None:
    """The vision projector to pull with `model` (the first file of its set), by the rule in the module docstring; None without one."""
    model_folders = model.path.split("/")[:-1]
    best, best_rank = None, None
    for file in sorted((file for file in files if file.is_projector), key=lambda file: file.path):
        folders = file.path.split("/")[:-1]
        if folders != model_folders[: len(folders)]:
            continue  # in another folder than the model's or one of its parents
        rank = (-len(folders), abs(file.bits - model.bits))
        if best_rank is None or rank < best_rank:
            best, best_rank = file, rank
    return best


def _quants(files: list[RepoFile]) -> str:
    return ", ".join(dict.fromkeys(file.quant or file.path for file in files))


def _split_set(first: RepoFile, models: list[RepoFile]) -> list[RepoFile]:
    """`first` alone, or all parts of its split set in order (an error when a part is missing)."""
    if first.split is None:
        return [first]
    prefix, _, count = first.split
    parts = {file.split[1]: file for file in models if file.split and file.split[0] == prefix and file.split[2] == count}
    missing = [index for index in range(1, count + 1) if index not in parts]
    if missing:
        raise NoGGUFError(f"{first.path} is part 1 of {count} but the repository lacks part(s) {missing}")
    return [parts[index] for index in range(1, count + 1)]


# ---- talking to the Hub (or reading its cache) ------------------------------------------------------


@attrs.frozen
class HubSettings:
    """The Hugging Face environment of one pull (None: huggingface_hub's own default)."""

    endpoint: str | None
    cache_dir: str | None
    offline: bool

    @classmethod
    def from_environment(cls) -> HubSettings:
        offline = huggingface_hub.is_offline_mode() or _truthy(os.environ.get("HF_HUB_OFFLINE"))
        return cls(os.environ.get("HF_ENDPOINT") or None, os.environ.get("HF_HUB_CACHE") or None, offline)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def list_files(ref: HubReference, settings: HubSettings) -> list[RepoFile]:
    """The repository's GGUF files: from the Hub (with LFS sizes and sha256), or from the cache offline."""
    if settings.offline:
        return _cached_files(ref, settings)
    api = huggingface_hub.HfApi(endpoint=settings.endpoint)
    with _hub_errors(ref):
        info = api.model_info(ref.repo_id, files_metadata=True)
    files = []
    for sibling in info.siblings or ():
        if not sibling.rfilename.lower().endswith(".gguf"):
            continue
        if not _REPO_PATH.fullmatch(sibling.rfilename) or {".", ".."} & set(sibling.rfilename.split("/")):
            log.warning("skipping a file with an unsafe name in %s: %r", ref.repo_id, sibling.rfilename)
            continue
        lfs = sibling.lfs
        sha256 = lfs.sha256 if lfs and isinstance(lfs.sha256, str) and _SHA256.fullmatch(lfs.sha256) else None
        files.append(RepoFile(sibling.rfilename, sibling.size, sha256))
    return files


def _cached_files(ref: HubReference, settings: HubSettings) -> list[RepoFile]:
    """GGUF files of the cached snapshot; a cache blob named by 64 hex digits is an LFS file's sha256."""
    try:
        folder = Path(huggingface_hub.snapshot_download(ref.repo_id, cache_dir=settings.cache_dir, local_files_only=True))
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, FileNotFoundError):
        raise HubOfflineError(
            f"HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of {ref.repo_id}; "
            "pull it once with the Hub reachable, or unset HF_HUB_OFFLINE"
        ) from None
    files = []
    for path in sorted(folder.rglob("*.gguf")):
        blob = path.resolve()
        sha256 = blob.name if _SHA256.fullmatch(blob.name) else None
        files.append(RepoFile(path.relative_to(folder).as_posix(), blob.stat().st_size, sha256))
    return files


def download(ref: HubReference, file: RepoFile, settings: HubSettings, report: Progress, force: bool = False) -> Path:
    """The file in the HF cache, downloaded through hf_hub_download when it is not there yet."""
    label = _label(file)
    progress_class = _progress_class(report, label, file.size)
    with _hub_errors(ref):
        path = huggingface_hub.hf_hub_download(
            ref.repo_id,
            file.path,
            cache_dir=settings.cache_dir,
            endpoint=settings.endpoint,
            local_files_only=settings.offline,
            force_download=force,
            tqdm_class=progress_class,
        )
    size = os.path.getsize(path)
    report({**label, "total": size, "completed": size})
    return Path(path)


def _label(file: RepoFile) -> dict:
    """The progress fields naming one file: Ollama's `pulling <12 hex>` with its digest when known."""
    if file.sha256:
        return {"status": f"pulling {file.sha256[:12]}", "digest": f"sha256:{file.sha256}"}
    return {"status": f"pulling {file.path.rsplit('/', 1)[-1]}"}


def _progress_class(report: Progress, label: dict, size: int | None) -> type:
    """A class huggingface_hub drives like tqdm (made with keyword arguments, `update(n)`), reporting to `report`."""

    class HubProgress:
        def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs) -> None:
            self.total = total or size or 0
            self.completed = initial or 0

        def __enter__(self) -> HubProgress:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

        def update(self, n: int = 1) -> None:
            self.completed += n
            report({**label, "total": self.total, "completed": self.completed})

        def close(self) -> None:
            pass

    return HubProgress


@contextlib.contextmanager
def _hub_errors(ref: HubReference) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into corral errors whose messages say what to do (and hold no token)."""
    repo = ref.repo_id
    try:
        yield
    except CorralError:
        raise
    except hub_errors.GatedRepoError:
        raise HubRepoNotFoundError(f"the Hugging Face repository {repo} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except hub_errors.RepositoryNotFoundError:
        message = f"no Hugging Face repository {repo} (if it is private, set HF_TOKEN to a token that can read it)"
        raise HubRepoNotFoundError(message) from None
    except hub_errors.LocalEntryNotFoundError:
        if HubSettings.from_environment().offline:
            raise HubOfflineError(f"HF_HUB_OFFLINE is set and the Hugging Face cache lacks files of {repo}") from None
        raise HubPullError(f"cannot reach the Hugging Face Hub for {repo}, and its cache lacks the files; check HF_ENDPOINT") from None
    except (hub_errors.RevisionNotFoundError, hub_errors.RemoteEntryNotFoundError):
        raise HubPullError(f"the Hugging Face repository {repo} changed during the pull; pull again") from None
    except hub_errors.HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "no"
        raise HubPullError(f"the Hugging Face Hub answered HTTP {status} for {repo}; try again later") from None
    except Exception as error:
        # Connection errors come from huggingface_hub's HTTP client (httpx, or its fork httpx2 in 2.x), which
        # corral does not import; anything else is a bug and stays what it is. A full disk is neither.
        if is_full_disk(error):
            raise HubCacheFullError(
                f"the disk holding the Hugging Face cache (HF_HUB_CACHE) is full while pulling {repo}; free some space "
                "(`hf cache delete` removes cached models) or set HF_HUB_CACHE to a folder on a larger disk"
            ) from None
        if not isinstance(error, OSError) and not type(error).__module__.startswith("httpx"):
            raise
        raise HubPullError(f"cannot reach the Hugging Face Hub for {repo}: {type(error).__name__}; check HF_ENDPOINT") from error


# ---- into the store ------------------------------------------------------------------------------------


def pull(store: Store, name: str | ModelName, progress: Progress | None = None) -> Manifest:
    """Fetch `hf.co/<user>/<repo>[:<quant>]` (and its vision projector) into the store; on failure the store is as it was."""
    report = progress or (lambda event: None)
    ref = parse_reference(name)
    settings = HubSettings.from_environment()
    report({"status": "pulling manifest"})
    listed = list_files(ref, settings)
    files = choose_files(listed, ref.tag, ref.repo_id, settings.offline)
    projector = choose_projector(listed, files[0])
    present = _present_blobs(store)
    pulled: list[str] = []  # digests this pull put into the store, in order
    try:
        if len(files) == 1:
            pulled.append(_single_into_store(store, ref, files[0], settings, report))
        else:
            pulled.append(_split_into_store(store, ref, files, settings, report))
        layers = [(MODEL_MEDIA_TYPE, pulled[0])]
        if projector is not None:
            pulled.append(_single_into_store(store, ref, projector, settings, report))
            if usable_projector(store.blob_path(pulled[0]), store.blob_path(pulled[1]), f"{ref.repo_id}/{projector.path}"):
                layers.append((PROJECTOR_MEDIA_TYPE, pulled[1]))
        report({"status": "writing manifest"})
        manifest = store.write_manifest(ref.name, layers)
    except BaseException:
        store.prune([digest for digest in pulled if digest not in present])  # unless some other manifest uses them
        raise
    store.prune([digest for digest in pulled[1:] if digest not in present])  # a projector left out goes again
    report({"status": "success"})
    return manifest


def usable_projector(model: Path, projector: Path, label: str) -> bool:
    """Whether the projector file is one an installed vision encoder reads, beside a text model that takes images;
    a warning says why not."""
    from corral.registry import Plugins

    plugins = Plugins()
    try:
        with contextlib.closing(GGUFFile.open(projector)) as vision, contextlib.closing(GGUFFile.open(model)) as text:
            plugins.vision_encoder_for(vision)
            if plugins.architecture_for(text).image_markers() is None:
                log.warning("leaving out the projector %s: %s models take no images", label, text.architecture)
                return False
    except (GGUFError, UnknownArchitectureError) as error:
        log.warning("leaving out the projector %s, so the model will not take images: %s", label, str(error).removeprefix(f"{projector}: "))
        return False
    return True


def _present_blobs(store: Store) -> set[str]:
    if not store.blobs_dir.is_dir():
        return set()
    return {"sha256:" + path.name.removeprefix("sha256-") for path in store.blobs_dir.glob("sha256-*")}


def _single_into_store(store: Store, ref: HubReference, file: RepoFile, settings: HubSettings, report: Progress) -> str:
    expected = f"sha256:{file.sha256}" if file.sha256 else None
    if expected and store.has_blob(expected):
        report({**_label(file), "total": file.size or 0, "completed": file.size or 0})
        return expected  # verified when it entered the store
    path = download(ref, file, settings, report)
    try:
        return link_blob(store, path, expected, report)
    except DigestMismatchError:
        if settings.offline:
            raise
        # The cached copy is damaged: fetch it once more (hf never rewrites a cache blob in place, so
        # a store blob linked to the old one is not touched).
        log.warning("the Hugging Face cache's copy of %s/%s does not match its sha256; downloading it again", ref.repo_id, file.path)
        return link_blob(store, download(ref, file, settings, report, force=True), expected, report)


def link_blob(store: Store, source: Path, expected: str | None, report: Progress) -> str:
    """Put a file into the store under its sha256: a hard link to it when possible, else one copy."""
    real = source.resolve()
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    temporary = store.blobs_dir / f".partial-{secrets.token_hex(8)}"
    try:
        os.link(real, temporary)
    except OSError:
        log.info("cannot hard link %s into the store (another filesystem?); copying it", real.name)
        report({"status": "verifying sha256 digest"})
        with store.blob_writer() as writer, open(real, "rb") as file:
            writer.copy_from(file)
            return writer.commit(expected)
    try:
        report({"status": "verifying sha256 digest"})
        with open(temporary, "rb") as file:
            digest = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
        if expected is not None and digest != expected:
            raise DigestMismatchError(f"{source.name} has digest {digest}, the Hub announced {expected}")
        os.replace(temporary, store.blob_path(digest))
        return digest
    finally:
        temporary.unlink(missing_ok=True)


def _split_into_store(store: Store, ref: HubReference, files: list[RepoFile], settings: HubSettings, report: Progress) -> str:
    paths = [download(ref, file, settings, report) for file in files]
    for file, path in zip(files, paths, strict=True):
        if file.sha256:
            _verify_part(ref, file, path, settings, report)
    report({"status": f"merging {len(files)} split files"})
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    temporary = store.blobs_dir / f".partial-{secrets.token_hex(8)}.gguf"
    try:
        try:
            merge_split(paths, temporary)
        except (GGUFError, ValueError, KeyError) as error:  # ValueError, KeyError: gguf-py's reader on a file that is not a GGUF
            raise HubPullError(f"the split files of {ref.repo_id} cannot be merged: {error}") from error
        return link_blob(store, temporary, None, report)
    finally:
        temporary.unlink(missing_ok=True)


def _verify_part(ref: HubReference, file: RepoFile, path: Path, settings: HubSettings, report: Progress) -> None:
    """A split part's bytes against the Hub's sha256 (parts do not enter the store, so they are checked here)."""
    report({"status": "verifying sha256 digest"})
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != file.sha256:
        raise DigestMismatchError(
            f"{file.path} of {ref.repo_id} has sha256 {digest}, the Hub announced {file.sha256}; "
            "remove it from the Hugging Face cache (hf cache delete) and pull again"
        )
