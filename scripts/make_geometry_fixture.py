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
import json
import random
from pathlib import Path

from pipeline_steps.local.geometry_figures import PROBLEM, SIDES, figure  # the warm-up draws with it too

OUT = Path(__file__).resolve().parents[1] / "pipeline_steps/local/hub/hiyouga/geometry3k"
SPLITS = {"train": 8, "validation": 2, "test": 4}  # figures per answer
SEED = 47


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
