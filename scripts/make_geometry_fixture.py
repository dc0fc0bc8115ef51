"""Writes the offline Hub's geometry3k fixture revision v2 (pipeline_steps/local/hub/hiyouga/geometry3k/v2): figures
drawn like geometry3k's (black lines on white, lettered vertices, labelled sides), in its columns (``images``,
``problem``, ``answer``, ``id``, ``choices``, ``ground_truth``).

Every problem has the same text ("<image>Each side of the polygon in the figure has length 1. Find its perimeter."):
the answer (3, 4, 5 or 6, the number of sides) is in the figure only, equally often in every split, so a model
blind to the image, or one constant answer, scores 25% at best. Figures differ in size, rotation and position.
Deterministic (seeded); the output is committed, so a Pillow upgrade does not change the fixture's bytes.

    python -m scripts.make_geometry_fixture   (needs Pillow)
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "pipeline_steps/local/hub/hiyouga/geometry3k"
SIDES = (3, 4, 5, 6)
SPLITS = {"train": 8, "validation": 2, "test": 4}  # figures per answer
SIZE = (112, 112)  # 4 x 4 image tokens for Qwen2.5-VL (28 x 28 pixels each)
PROBLEM = "<image>Each side of the polygon in the figure has length 1. Find its perimeter."
SEED = 47


def figure(sides: int, rng: random.Random) -> bytes:
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


def main() -> None:
    rng = random.Random(SEED)
    index = 0
    for split, per in SPLITS.items():
        rows = []
        for k in range(per):
            for s in SIDES:
                choices = [str(s), str(s + 1), str(s + 2), str(s - 1)]
                rows.append(
                    {
                        "images": [{"bytes_b64": base64.b64encode(figure(s, rng)).decode(), "path": None}],
                        "problem": PROBLEM,
                        "answer": str(s),
                        "id": str(index),
                        "choices": choices,
                        "ground_truth": "A",
                    }
                )
                index += 1
        rng.shuffle(rows)
        path = OUT / "v2" / "data" / f"{split}-00000-of-00001.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    revs = json.loads((OUT / "revisions.json").read_text())
    if not any(r["label"] == "v2" for r in revs):
        revs.append({"label": "v2", "date": "2026-08-01T00:00:00+00:00"})
        (OUT / "revisions.json").write_text(json.dumps(revs, indent=2) + "\n")


if __name__ == "__main__":
    main()
