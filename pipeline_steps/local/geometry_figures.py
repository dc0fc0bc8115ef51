"""Polygon figures drawn like geometry3k's (black lines on white, lettered vertices, one side labelled 1).

The offline Hub's geometry3k fixture v2 (``scripts/make_geometry_fixture.py``, output committed) and the tiny
vision-language model's warm-up (:mod:`pipeline_steps.local.tiny_vl_model`) draw with the same function, the warm-up
with its own seed: it sees polygons like the fixture's, never the fixture's figures.
"""

from __future__ import annotations

import io
import math
import random

SIDES = (3, 4, 5, 6)  # the answer (the perimeter, every side 1) is the number of sides
SIZE = (112, 112)  # 4 x 4 image tokens for Qwen2.5-VL (28 x 28 pixels each)
PROBLEM = "<image>Each side of the polygon in the figure has length 1. Find its perimeter."


def figure(sides: int, rng: random.Random) -> bytes:
    """A PNG of a regular polygon with ``sides`` sides, its size, rotation and position drawn from ``rng``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", SIZE, "white")
    d = ImageDraw.Draw(img)
    cx, cy = SIZE[0] / 2 + rng.uniform(-6, 6), SIZE[1] / 2 + rng.uniform(-6, 6)
    r = rng.uniform(30, 40)
    rot = rng.uniform(0, 2 * math.pi)
    pts = [
        (cx + r * math.cos(rot + 2 * math.pi * i / sides), cy + r * math.sin(rot + 2 * math.pi * i / sides))
        for i in range(sides)
    ]
    d.polygon(pts, outline="black", width=2)
    for i, (x, y) in enumerate(pts):  # vertex letters outside the figure
        dx, dy = x - cx, y - cy
        n = math.hypot(dx, dy) or 1
        d.text((x + 8 * dx / n - 3, y + 8 * dy / n - 5), "ABCDEF"[i], fill="black")
    a, b = pts[0], pts[1]  # one side labelled 1, as geometry3k labels lengths
    mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
    dx, dy = mx - cx, my - cy
    n = math.hypot(dx, dy) or 1
    d.text((mx + 7 * dx / n - 3, my + 7 * dy / n - 5), "1", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()
