"""Images in: decoded with Pillow, checked against limits, resized and normalised as a vision encoder says.

A vision encoder declares its input as an `ImageSpec` (from its projector file's `clip.vision.*`
keys); `preprocess` turns any image Pillow reads into the float32 [3, height, width] array the
encoder's graph takes, the way Hugging Face's image processors (the PIL ones) do it: RGB (transparency
composited onto white), resized with Pillow's filter, scaled to [0, 1], normalised per channel.
"""

from __future__ import annotations

import hashlib
import io
import warnings

import attrs
from typing import TYPE_CHECKING

from corral.errors import CorralError

# Pillow loads when an image is decoded and numpy when one is preprocessed (in a runner), not with this
# module: the server imports it and stays small.
if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

# The most pixels an image may have before it is decoded (Pillow's own bomb check warns at 89 M and
# refuses at twice that; a 24 MP photo passes, a 100 MP one does not).
MAX_PIXELS = 50_000_000

MAX_IMAGE_BYTES = 64 << 20  # an image file fetched or decoded from a request: 64 MiB
RESAMPLE = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "nearest": "NEAREST"}  # names of PIL.Image.Resampling


class ImageError(CorralError):
    """An input that is not an image corral can read, or one past a limit."""


@attrs.frozen
class ImageSpec:
    """What an encoder takes: a square of `size` pixels resized with `resample`, normalised by mean and std.

    `fit` says how an image that is not square becomes one: "stretch" resizes it to the square, "crop"
    resizes its shorter side to `size` and cuts the middle square (HF's `shortest_edge` + `crop_size`)."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: str = "bilinear"
    fit: str = "stretch"


@attrs.frozen
class DecodedImage:
    """An image read from its bytes, and the sha256 of those bytes (what its embeddings are cached by)."""

    image: Image.Image = attrs.field(eq=False)
    digest: str


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> DecodedImage:
    """Read an image from its file bytes (PNG, JPEG, WebP, GIF's first frame, ...); ImageError if it is
    not one or it has more than `max_pixels` pixels (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"the image is {width}x{height} pixels, more than the {max_pixels} allowed; send a smaller image")
            image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"not an image corral can read ({_reason(exc)})") from None
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file of a known format
        raise ImageError(f"the image could not be decoded ({exc})") from None
    return DecodedImage(image, hashlib.sha256(data).hexdigest())


def _reason(exc: Exception) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "no image format recognises the data"
    return "too many pixels"


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as RGB; a transparent one composited onto white first (what HF's `convert_rgb` does)."""
    if image.mode == "RGB":
        return image
    from PIL import Image

    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def preprocess(image: Image.Image, spec: ImageSpec) -> np.ndarray:
    """float32 [3, size, size]: RGB, fitted to the square, scaled by 1/255, normalised (the HF processors' PIL path)."""
    import numpy as np

    resized = fit_square(to_rgb(image), spec)
    # In float64 and then float32, as transformers' rescale and normalize compute it: equal to its pixels.
    pixels = (np.asarray(resized, dtype=np.float64) * (1 / 255)).astype(np.float32)
    pixels = (pixels - np.asarray(spec.mean, dtype=np.float32)) / np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


def fit_square(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """The image as a `spec.size` square, the way `spec.fit` says."""
    from PIL import Image

    resample, size = getattr(Image.Resampling, RESAMPLE[spec.resample]), spec.size
    if spec.fit == "stretch":
        return image.resize((size, size), resample=resample)
    # "crop": the shorter side becomes `size` and the longer one scales with it, truncated as transformers'
    # get_resize_output_image_size does; then the middle square, its offset rounded down.
    width, height = image.size
    if width <= height:
        scaled = (size, int(size * height / width))
    else:
        scaled = (int(size * width / height), size)
    resized = image.resize(scaled, resample=resample)
    left, top = (scaled[0] - size) // 2, (scaled[1] - size) // 2
    return resized.crop((left, top, left + size, top + size))
