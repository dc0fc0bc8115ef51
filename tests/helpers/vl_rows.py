"""geometry3k rows as the pipeline's preprocess step writes them, from the offline Hub's fixture (revision v2: the
polygons whose number of sides is in the figure only), and blank-image copies of them."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "pipeline_steps/local/hub/hiyouga/geometry3k/v2/data"
# the local_tiny_vl preset's pixel limits (data.mm_processor_kwargs)
PRESET_MM = {"min_pixels": 3136, "max_pixels": 12544}


def geo3k_rows(split: str = "test", n: int | None = None) -> list[dict]:
    from pipeline_steps.data.preprocessors import geometry3k

    raw = [json.loads(line) for line in (FIXTURE / f"{split}-00000-of-00001.jsonl").read_text().splitlines()]
    out = []
    for i, r in enumerate(raw[:n]):
        r["images"] = [{"bytes": base64.b64decode(im["bytes_b64"]), "path": None} for im in r["images"]]
        row = geometry3k.convert_row(r, split, i, geometry3k.DATA_SOURCE)
        row.pop("_key_extra")
        out.append(row)
    return out


def blank_png(like: bytes) -> bytes:
    """A white image of the same size as ``like``."""
    from PIL import Image

    with Image.open(io.BytesIO(like)) as im:
        size = im.size
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return buf.getvalue()


def with_blank_images(row: dict) -> dict:
    return {**row, "images": [{"bytes": blank_png(im["bytes"]), "path": None} for im in row["images"]]}


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
