"""OpenAI's image content parts: `data:` URLs decoded; http(s) URLs fetched only when the server allows it.

Fetching a URL a request names makes the server a client of any host the request chooses, so it is off
unless CORRAL_FETCH_IMAGE_URLS=1; then a fetch is bounded in time and size.
"""

from __future__ import annotations

import base64
import binascii
import os
import re



from corral.images import MAX_IMAGE_BYTES
from corral.server.http import ApiError

FETCH_ENV = "CORRAL_FETCH_IMAGE_URLS"
FETCH_TIMEOUT = 10.0  # seconds for one image URL
DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*);base64,(?P<data>.*)", re.DOTALL)


def image_part_url(part: dict) -> str:
    """The URL of an `image_url` part (`{"url": ...}` or a bare string) or an `input_image` part; 400 without one."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"an {part['type']} content part needs an image URL (image_url.url)")
    return url


def fetching_allowed() -> bool:
    return os.environ.get(FETCH_ENV, "").strip().lower() in ("1", "true", "yes")


async def resolve_image_parts(parts: list[dict]) -> list[bytes]:
    """Each image part's bytes: a base64 data URL decoded, an http(s) one fetched if allowed; 400 otherwise."""
    return [await _image_bytes(image_part_url(part)) for part in parts]


async def _image_bytes(url: str) -> bytes:
    if url.startswith("data:"):
        match = DATA_URL.fullmatch(url)
        if match is None:
            raise ApiError(400, "an image data URL must be base64: data:image/<type>;base64,<data>")
        try:
            return base64.b64decode(match.group("data"), validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data URL is not valid base64") from None
    if url.startswith(("http://", "https://")):
        if not fetching_allowed():
            raise ApiError(400, f"image URLs over http(s) are not fetched by this server; send the image as a data: URL, or start the server with {FETCH_ENV}=1")
        return await _fetch(url)
    raise ApiError(400, "an image URL must be a data: URL (or http(s) where the server fetches them)")


async def _fetch(url: str) -> bytes:
    """GET `url`, at most MAX_IMAGE_BYTES and FETCH_TIMEOUT seconds."""
    import httpx  # here: only a server that fetches image URLs needs an HTTP client

    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ApiError(400, f"fetching the image URL gave HTTP {response.status_code}")
                data = bytearray()
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > MAX_IMAGE_BYTES:
                        raise ApiError(400, f"the image at the URL is larger than {MAX_IMAGE_BYTES} bytes")
                return bytes(data)
    except httpx.HTTPError as exc:
        raise ApiError(400, f"the image URL could not be fetched ({type(exc).__name__})") from None


