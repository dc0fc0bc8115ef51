"""Thumbnails of the evaluated figures (geometry3k), for the run report beside the model's answers.

The evaluate step writes one small PNG per image row (``eval/figures/NNNN.png``, NNNN the problem's position in
``results.json``); the report re-reads each through Pillow and re-encodes it (:func:`thumbnail`), so only pixels
reach the page: a file that is not an image, or one too large, is left out. The report's HTML inlines them as
``data:image/png`` URIs, the only images its Content-Security-Policy allows (``img-src data:``). Bounded: at most
``MAX_SIDE`` pixels a side and ``MAX_BYTES`` per image, ``MAX_REPORT_BYTES`` for all of a report's figures.
"""

from __future__ import annotations

import io
import logging

log = logging.getLogger(__name__)

MAX_SIDE = 96
MAX_BYTES = 16 * 1024
MAX_REPORT_BYTES = 256 * 1024
MAX_SOURCE_PIXELS = 4096 * 4096  # refused before decoding: a decompression bomb is not decoded at all


def name(position: int) -> str:
    return f"{position:04d}.png"


def thumbnail(data: bytes) -> bytes | None:
    """A PNG of at most ``MAX_SIDE`` pixels a side and ``MAX_BYTES``, re-drawn from ``data``'s pixels; None when
    ``data`` is not an image Pillow reads, or it does not fit the bounds even as 16 grey levels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_SOURCE_PIXELS or min(im.size) < 1:
                return None
            im = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    im.thumbnail((MAX_SIDE, MAX_SIDE))
    for candidate in (im, im.convert("L").quantize(16)):  # figures are line drawings: 16 greys keep them legible
        buf = io.BytesIO()
        candidate.save(buf, format="PNG", optimize=True)
        if buf.tell() <= MAX_BYTES:
            return buf.getvalue()
    return None
