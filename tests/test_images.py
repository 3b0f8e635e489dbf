"""Images in (corral.images): decoding with its limits, and preprocessing against Hugging Face's image
processors (the PIL ones Gemma 3 and SigLIP use) pixel for pixel."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from corral.images import RESAMPLE, ImageError, ImageSpec, decode, preprocess


def png(image: Image.Image, format: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=format)
    return out.getvalue()


def pattern(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """Gradients and noise (seeded) in `mode`, so that any resampling difference shows."""
    rng = np.random.default_rng(width * 1000 + height)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), rng.integers(0, 256, (height, width))], axis=-1)
    image = Image.fromarray(rgb.astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(((x + y) * 255 // (width + height)).astype(np.uint8), "L")
        image.putalpha(alpha)
        return image
    return image.convert(mode)


IMAGES = {
    "rgb-downscaled": pattern(300, 200),
    "rgb-upscaled": pattern(13, 29),
    "rgba-transparent": pattern(64, 48, "RGBA"),
    "grayscale": pattern(50, 70, "L"),
    "palette": pattern(40, 40, "P"),
}


@pytest.mark.slow  # imports transformers' image processors
@pytest.mark.parametrize("name", sorted(IMAGES))
@pytest.mark.parametrize("processor_class", ["Gemma3ImageProcessorPil", "SiglipImageProcessorPil"])
def test_preprocessing_gives_the_hf_processors_pixels_exactly(name, processor_class):
    import transformers

    size = 56
    processor = getattr(transformers, processor_class)(size={"height": size, "width": size})
    image = decode(png(IMAGES[name])).image
    expected = processor(images=[image], return_tensors="np")["pixel_values"][0]
    resample = {filter: name for name, filter in RESAMPLE.items()}[Image.Resampling(processor.resample).name]  # SigLIP's is bicubic
    spec = ImageSpec(size, tuple(processor.image_mean), tuple(processor.image_std), resample)
    np.testing.assert_array_equal(preprocess(image, spec), expected)


def test_an_image_is_decoded_with_the_digest_of_its_bytes():
    data = png(pattern(20, 10))
    decoded = decode(data)
    assert decoded.image.size == (20, 10) and decoded.digest == __import__("hashlib").sha256(data).hexdigest()


def test_the_same_picture_in_another_file_has_another_digest():
    image = pattern(20, 10)
    assert decode(png(image)).digest != decode(png(image, "BMP")).digest


@pytest.mark.parametrize("data", [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20], ids=["empty", "text", "bare-png-magic"])
def test_bytes_that_are_not_an_image_are_an_image_error(data):
    with pytest.raises(ImageError, match="not an image|could not be decoded"):
        decode(data)


def test_a_truncated_image_is_an_image_error():
    data = png(pattern(100, 100))
    with pytest.raises(ImageError, match="could not be decoded"):
        decode(data[: len(data) // 2])


def test_an_image_over_the_pixel_limit_is_refused_before_decoding():
    data = png(pattern(100, 100))
    with pytest.raises(ImageError, match="100x100 pixels, more than the 5000 allowed"):
        decode(data, max_pixels=5000)
