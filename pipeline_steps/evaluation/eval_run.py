"""One model evaluated: generate, score, record; a base model's results cached; the evaluate step's outputs.

A base model's results are cached (``--baseline-cache``) under a key made of the model's content hash, the
evaluation set's hash, the sampling settings and the scorer, so a base model is scored once per revision.

Outputs (:func:`write_outputs`, one atomic directory): ``results.json`` (per problem: ground truth, each sample's
extracted answer and correctness, avg@k, pass@k, maj@k; overall; samples actually scored; base and gain),
``base_results.json`` (with a base model), ``results.md`` (:mod:`pipeline_steps.evaluation.results_page`),
``generations.jsonl`` (the raw responses) and, for image rows, ``figures/NNNN.png`` (small thumbnails of each row's
first image, :mod:`pipeline_steps.evaluation.figures`) that the run report shows beside the answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from pipeline_steps import atomic
from pipeline_steps.evaluation import figures, results_page
from pipeline_steps.evaluation import metrics as eval_metrics
from pipeline_steps.evaluation.eval_set import row_images
from pipeline_steps.evaluation.generation import GENERATORS
from pipeline_steps.evaluation.scoring import SCORER, score
from pipeline_steps.planning import layout

log = logging.getLogger(__name__)


def cache_key(model_sha: str, eval_sha: str, s: dict) -> str:
    blob = json.dumps({"model": model_sha, "eval": eval_sha, "sampling": s, "scorer": SCORER}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def evaluate_model(
    model: dict, model_sha: str, rows: list[dict], eval_info: dict, s: dict, cache_dir=None, batch_size: int = 0
) -> tuple[dict, list]:
    """Score one model. ``model``: ``{"path" (as given), "dir" (the Hugging Face directory), "source", "step"}``.
    Returns (results, generations); looked up in and written to ``cache_dir`` when it is set."""
    key = cache_key(model_sha, eval_info["sha256"], s)
    cached = Path(cache_dir) / f"{key}.json" if cache_dir else None
    if cached and cached.is_file():
        log.info("base model results from cache %s", cached)
        res = json.loads(cached.read_text(encoding="utf-8"))
        res["overall"].setdefault("answers", eval_metrics.figures_of(res))  # cached before the figures existed
        return res, []
    gens = GENERATORS[s["generator"]](Path(model["dir"]), rows, s, batch_size)
    res = score(rows, gens)
    res.update(
        {
            "model": {
                "path": str(model["path"]),
                "source": model["source"],
                "step": model["step"],
                "content_sha256": model_sha,
            },
            "eval_set": eval_info,
            "sampling": s,
            "scorer": SCORER,
            "key": key,
            "verl_version": _verl_version(),
        }
    )
    if cached:
        atomic.write_json(cached, res)
    return res, gens


def _verl_version() -> str:
    from importlib.metadata import version

    return version("verl")


def add_base(res: dict, base: dict) -> None:
    """The base's figures and the gain over it, in the model's results."""
    res["base"] = {"model": base["model"], "overall": base["overall"]}
    res["gain"] = {m: res["overall"][m] - base["overall"][m] for m in ("avg@k", "maj@k")}
    res["gain"]["pass@k"] = {
        j: res["overall"]["pass@k"][j] - base["overall"]["pass@k"][j] for j in res["overall"]["pass@k"]
    }


def write_outputs(out: Path, res: dict, base: dict | None, gens: list, rows: list[dict]) -> None:
    with atomic.atomic_dir(out, owner="evaluate") as tmp:
        shown = write_figures(tmp / layout.EVAL_FIGURES, rows)
        if shown:
            res["figures"] = {"dir": layout.EVAL_FIGURES, "count": shown}
        atomic.write_json(tmp / layout.EVAL_RESULTS, res)
        if base is not None:
            atomic.write_json(tmp / layout.BASE_RESULTS, base)
        atomic.write_text(tmp / "results.md", results_page.render(res, base))
        with open(tmp / "generations.jsonl", "w", encoding="utf-8") as f:
            for p, texts in zip(res["problems"], gens):
                f.write(json.dumps({"id": p["id"], "responses": texts}, ensure_ascii=False) + "\n")


def write_figures(directory: Path, rows: list[dict]) -> int:
    """A thumbnail of each image row's first image, named by the row's position; how many were written."""
    n = 0
    for i, row in enumerate(rows):
        images = row_images(row)
        thumb = figures.thumbnail(images[0]) if images else None
        if thumb is None:
            continue
        directory.mkdir(exist_ok=True)
        (directory / figures.name(i)).write_bytes(thumb)
        n += 1
    return n


def summary(out: Path, res: dict, base: dict | None) -> dict:
    """The step's one-line JSON summary."""
    o = res["overall"]
    return {
        "output": str(out),
        "results": str(out / layout.EVAL_RESULTS),
        "base_results": str(out / layout.BASE_RESULTS) if base is not None else None,
        "problems": o["problems"],
        "k": o["k"],
        "samples_scored": o["samples_scored"],
        "avg@k": o["avg@k"],
        "pass@k": o["pass@k"],
        "maj@k": o["maj@k"],
        "gain_avg@k": (res.get("gain") or {}).get("avg@k"),
    }
