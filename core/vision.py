"""A loaded vision encoder and how images enter a prompt.

A projector file (llama.cpp's `clip` architecture, Ollama's `projector` layer) is bound by the vision
encoder plugin its `clip.projector_type` names; `ImageEncoder` runs it through the same backend as the
text model and keeps each image's embeddings by the digest of its bytes, so a conversation that sends
the same image again does not encode it again.

In a prompt an image is a run of embedding rows, wrapped in the text the architecture declares
(`image_markers`: Gemma 3's `<start_of_image>` ... `<end_of_image>`); `ImageRun` marks where the run
starts and `image_batch_fields` turns runs into a Batch's `embeddings`, `embedding_rows` and `blocks`.
"""

from __future__ import annotations

import collections
import pathlib
import re
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from corral.errors import CorralError, ProjectorError
from corral.gguf import GGUFFile
from corral.images import DecodedImage, ImageSpec, decode, preprocess
from corral.model import Batch

EMBEDDINGS_KEPT = 32  # images whose embeddings stay cached per loaded encoder
IMAGE_FILLER = 0  # the token id an image row carries (its embedding is replaced): any valid row of the table
# Where image N of a request goes in its rendered prompt, as Ollama's server marks it for its runner.
IMAGE_TAG = re.compile(r"\[img-(\d+)\]")


@attrs.frozen
class ImageRun:
    """One image in a prompt: its embeddings [tokens, dim] start at prompt index `start`."""

    start: int
    embeddings: Any = attrs.field(eq=False)
    digest: str = ""

    @property
    def length(self) -> int:
        return int(self.embeddings.shape[0])


class ImageEncoder:
    """A vision encoder bound to a backend, with its embeddings kept by image digest."""

    def __init__(self, path: pathlib.Path, encoder: Any, backend: Any):
        self.path, self.encoder, self.backend = path, encoder, backend
        self._kept: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._digests: dict[int, str] = {}  # placeholder id -> digest, for a context passed back without its images
        self.encoded = 0  # images actually run through the encoder (not served from the cache)

    @classmethod
    def open(cls, path: str | pathlib.Path, backend: Any, plugins: Any, text_width: int | None = None) -> ImageEncoder:
        """Bind the projector at `path` through `backend`; ProjectorError if its output does not match the text model's width."""
        path = pathlib.Path(path)
        gguf = GGUFFile.open(path)
        encoder = plugins.vision_encoder_for(gguf).from_gguf(gguf, backend)
        width = encoder.output_width
        if text_width is not None and width != text_width:
            raise ProjectorError(f"{path}: the projector gives {width}-wide embeddings but the text model takes {text_width}; it belongs to another model")
        return cls(path, encoder, backend)

    @property
    def spec(self) -> ImageSpec:
        return self.encoder.image_spec()

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.tokens_per_image()

    def pixels(self, image: DecodedImage) -> np.ndarray:
        """The encoder's input for `image`."""
        return preprocess(image.image, self.spec)

    def encode(self, image: DecodedImage | bytes) -> Any:
        """The image's embeddings [tokens_per_image, text width] (a backend tensor), from the cache when it was seen."""
        if isinstance(image, bytes):
            image = decode(image)
        kept = self._kept.get(image.digest)
        if kept is not None:
            self._kept.move_to_end(image.digest)
            return kept
        embeddings = self.encode_pixels(self.pixels(image))
        self.encoded += 1
        self._kept[image.digest] = embeddings
        self._digests[placeholder_id(image.digest)] = image.digest
        while len(self._kept) > EMBEDDINGS_KEPT:
            gone, _ = self._kept.popitem(last=False)
            self._digests.pop(placeholder_id(gone), None)
        return embeddings

    def encode_pixels(self, pixels: np.ndarray) -> Any:
        """The encoder's graph over preprocessed pixels, computed (no cache)."""
        # The patches are one sequence's rows and there is no cache: told so, the backend runs each
        # projection over all of a tensor's rows in one call, whatever rows the graph kept (without a
        # batch it treats rows as lone decode rows, in chunks of a few: 4x slower in a Gemma 3-shaped block).
        patches = Batch.single(np.zeros(self.encoder.tower_rows, dtype=np.int64))
        ctx = self.backend.new_context(patches)
        (embeddings,) = ctx.compute(self.encoder.encode(ctx, pixels))
        return embeddings

    def kept(self, placeholder: int) -> Any:
        """The embeddings of the image whose rows carry `placeholder`, if still kept; else None."""
        digest = self._digests.get(placeholder)
        return None if digest is None else self._kept.get(digest)


def placeholder_id(digest: str) -> int:
    """The id an image's rows carry in a prompt's token list: negative (never a vocabulary id) and
    the same for the same image, so a cached prefix is reused only up to where the images differ."""
    return -1 - int(digest[:15], 16)


def tag_images(text: str, count: int, first: int = 0) -> str:
    """`text` with tags for images first .. first + count - 1 in front, unless it places them itself."""
    if count == 0 or IMAGE_TAG.search(text):
        return text
    return "".join(f"[img-{i}]" for i in range(first, first + count)) + text


def image_prompt_ids(
    tokenize: Callable[[str, bool], list[int]], text: str, images: Sequence[DecodedImage], markers: tuple[str, str], tokens_per_image: int
) -> list[int]:
    """Token ids of a rendered prompt with each `[img-N]` tag (N < len(images), first use) replaced by
    image N's rows (`tokens_per_image` placeholders) wrapped in the architecture's markers.

    `tokenize(text, add_special)`: special tokens are added to the first piece only. An image no
    tag places is an error: it would be silently dropped otherwise.
    """
    ids: list[int] = []
    placed: set[int] = set()
    start = 0
    pieces: list[str | int] = []
    for match in IMAGE_TAG.finditer(text):
        index = int(match.group(1))
        if index >= len(images) or index in placed:
            continue  # not one of this request's images: left as text
        pieces += [text[start : match.start()], index]
        placed.add(index)
        start = match.end()
    pieces.append(text[start:])
    if len(placed) != len(images):
        raise CorralError(f"{len(images) - len(placed)} of the request's images have no place in the prompt (the template dropped their message?)")
    before, after = markers
    for n, piece in enumerate(pieces):
        if isinstance(piece, str):
            if piece or n == 0:
                ids += tokenize(piece, n == 0)
            continue
        ids += tokenize(before, False) + [placeholder_id(images[piece].digest)] * tokens_per_image + tokenize(after, False)
    return ids


def image_runs(ids: Sequence[int], tokens_per_image: int) -> list[tuple[int, int, int]]:
    """(start, length, placeholder) of each image's rows in a prompt's ids (the same image twice in a row is two runs)."""
    runs: list[tuple[int, int, int]] = []
    for i, token in enumerate(ids):
        if token >= 0:
            continue
        if runs and runs[-1][2] == token and runs[-1][0] + runs[-1][1] == i and runs[-1][1] < tokens_per_image:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, token)
        else:
            runs.append((i, 1, token))
    return runs


def image_batch_fields(runs: Sequence[ImageRun], rows: Sequence[int], bidirectional: bool) -> dict[str, Any]:
    """A Batch's image fields for a batch whose row r holds prompt index rows[r]: every run must lie
    whole inside the batch (its rows attend to each other when `bidirectional`). {} without runs."""
    import torch

    if not runs:
        return {}
    index = {int(p): r for r, p in enumerate(rows)}
    parts, embedding_rows = [], []
    blocks = np.full(len(rows), -1, dtype=np.int64)
    for run in runs:
        batch_rows = [index[p] for p in range(run.start, run.start + run.length)]
        embedding_rows += batch_rows
        parts.append(run.embeddings if isinstance(run.embeddings, torch.Tensor) else torch.as_tensor(np.asarray(run.embeddings, dtype=np.float32)))
        blocks[batch_rows] = run.start
    fields = {"embeddings": torch.cat([p.float() for p in parts]), "embedding_rows": np.asarray(embedding_rows, dtype=np.int64)}
    if bidirectional:
        fields["blocks"] = blocks
    return fields
