"""Content parts of OpenAI chat messages: the part types served, and the images they carry."""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import urlsplit

from dynamo_prep.prompt import PromptRenderError
from dynamo_prep.protocol.preprocessed import ImageRef, image_uuid

__all__ = ["IMAGE_PART_TYPES", "TEXT_PART_TYPES", "collect_images", "image_uuid"]

MAX_HTTP_URL_CHARS = 8192
# Linear: one character class, then the padding (no two parts can match the same character).
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+(?:;[A-Za-z0-9=._+-]+)*;base64,[A-Za-z0-9+/\s]*={0,2}\Z")
_UNSAFE_URL_CHARS = re.compile(r"[\x00-\x20\x7f]")

# tuples, not sets: a formatter may test a client's unhashable ``type`` value against them
TEXT_PART_TYPES: Final = ("text",)
IMAGE_PART_TYPES: Final = ("image_url", "image")


def collect_images(messages: list[dict[str, Any]]) -> list[ImageRef]:
    """Image parts of every message, in order; unknown part types and bad URLs are ``PromptRenderError``s."""
    images: list[ImageRef] = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            where = f"messages[{index}].content[{part_index}]"
            if not isinstance(part, dict):
                raise PromptRenderError(f"{where}: a content part must be an object")
            part_type = part.get("type")
            if not isinstance(part_type, str):
                raise PromptRenderError(f"{where}: a content part needs a string 'type'")
            if part_type in IMAGE_PART_TYPES:
                images.append(_image_ref(part, where))
            elif part_type not in TEXT_PART_TYPES:
                raise PromptRenderError(
                    f"{where}: unknown content part type {part_type!r}; expected one of "
                    f"{', '.join(sorted((*TEXT_PART_TYPES, *IMAGE_PART_TYPES)))}"
                )
    return images


def _image_ref(part: dict[str, Any], where: str) -> ImageRef:
    image = part.get("image_url", part.get("image"))
    if isinstance(image, str):
        url, detail = image, None
    elif isinstance(image, dict) and isinstance(image.get("url"), str):
        url, detail = image["url"], image.get("detail")
    else:
        raise PromptRenderError(f"{where}: an image part needs image_url.url (a string)")
    _check_image_url(url, where)
    return ImageRef(url=url, detail=detail if isinstance(detail, str) else None, uuid=image_uuid(url))


def _check_image_url(url: str, where: str) -> None:
    """An http(s) URL with a host (no spaces or control characters, at most 8 KiB), or a base64
    ``data:image/...`` URL: anything else is the client's mistake, said before a worker sees it."""
    if url.startswith("data:"):
        if not _DATA_URL.match(url):
            raise PromptRenderError(
                f"{where}: a data: image URL must be data:image/<type>;base64,<base64 data>, got {url[:40]!r}"
            )
        return
    if not url.startswith(("http://", "https://")):
        raise PromptRenderError(
            f"{where}: image_url.url must be an http(s) URL or a data: URL, got {url[:40]!r}"
        )
    if len(url) > MAX_HTTP_URL_CHARS or _UNSAFE_URL_CHARS.search(url) or not urlsplit(url).hostname:
        raise PromptRenderError(
            f"{where}: image_url.url is not a valid http(s) URL (a host, no spaces or control characters, "
            f"at most {MAX_HTTP_URL_CHARS} characters): {url[:40]!r}"
        )
