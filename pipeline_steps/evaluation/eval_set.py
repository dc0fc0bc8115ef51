"""The evaluation set: a verl-schema parquet (prompt, data_source, reward_model.ground_truth, and for geometry3k its
``images``), checked row by row so a bad set fails in one line before any model is loaded."""

from __future__ import annotations

from pathlib import Path

from pipeline_steps.digests import sha256_file
from pipeline_steps.errors import UserError

IMAGE_KEY = "images"  # verl's data.image_key default, the column the geometry3k preprocessor writes
PLACEHOLDER = "<image>"  # one per image, in order (verl's RLHFDataset._build_messages)


def row_images(row: dict) -> list[bytes]:
    """The bytes of a row's images, in placeholder order (none for a text row)."""
    return [img["bytes"] for img in row.get(IMAGE_KEY) or [] if isinstance(img, dict) and img.get("bytes")]


def load_eval_set(path: str, max_problems: int = 0, name: str | None = None) -> tuple[list[dict], dict]:
    """Rows of a verl-schema parquet, checked: every row has a prompt, a data_source and a ground truth."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--data {p}: file not found; pass the evaluation parquet written by the preprocess step")
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:
        raise UserError(
            f"--data {p}: not a readable parquet file ({exc.__class__.__name__}); re-run preprocess"
        ) from None
    if not rows:
        raise UserError(f"--data {p}: no rows; the evaluation set is empty")
    for i, r in enumerate(rows):
        gt = (r.get("reward_model") or {}).get("ground_truth") if isinstance(r.get("reward_model"), dict) else None
        if gt is None or str(gt).strip() == "":
            raise UserError(
                f"--data {p}: row {i} has no reward_model.ground_truth; an evaluation set needs an answer for every "
                "problem"
            )
        if not r.get("data_source"):
            raise UserError(f"--data {p}: row {i} has no data_source; it selects verl's scorer (for AIME: aime2024)")
        prompt = r.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)):
            raise UserError(f"--data {p}: row {i} prompt is not a list of chat messages (role, content)")
    sources = sorted({str(r["data_source"]) for r in rows})
    info = {
        "path": str(p.resolve()),
        "sha256": sha256_file(p),
        "rows": len(rows),
        "name": name or "+".join(sources),  # the synthetic arithmetic set is scored as openai/gsm8k
        "file": p.name,
    }
    if max_problems:
        rows = rows[:max_problems]
    return rows, info
