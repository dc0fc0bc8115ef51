"""Evaluation rows made in the test, shared by the evaluation library's and the evaluate step's tests: AIME-shaped
text rows, plain PNGs, and geometry3k rows converted by the pipeline's own preprocessor (one ``<image>`` each)."""

from __future__ import annotations

import io


def aime_rows(n=2):
    from pipeline_steps.data.preprocessors.dapo_math import PROMPT_TEMPLATE

    return [
        {
            "data_source": "aime2024",
            "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=f"Find {i} + {i}.")}],
            "ability": "MATH",
            "reward_model": {"style": "rule-lean", "ground_truth": str(2 * i)},
            "extra_info": {"split": "test", "index": i, "id": f"2024-I-{i + 1}"},
        }
        for i in range(n)
    ]


def png(width=40, height=30, color="white") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def converted_geo3k_rows(n=2):
    """Rows as the pipeline's geometry3k preprocessor writes them (problem with one <image>, the image's bytes)."""
    from pipeline_steps.data.preprocessors import geometry3k

    raw = [
        {"problem": f"<image>Find x if the angle is {30 + i}.", "answer": str(30 + i), "images": [{"bytes": png()}]}
        for i in range(n)
    ]
    return [geometry3k.convert_row(r, "test", i, geometry3k.DATA_SOURCE) for i, r in enumerate(raw)]
