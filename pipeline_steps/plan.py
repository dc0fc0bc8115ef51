"""Plan one pipeline run from its parameters: which dataset revisions, which paths, which store locations.

Every location is derived from the inputs (dataset, commit, variant, content hash, run id), so a re-run or a
backfill over an unchanged revision finds its outputs already there and skips the work. Each function returns
``{"args": [...], "carry": {...}}`` for :class:`operators.step.PipelineStepOperator`; ``carry`` travels with a
dataset through download -> preprocess -> upload so each mapped task knows what it is working on.
Cheap to import: the DAG file uses these at parse time.
"""
from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from pipeline_steps import experiment, registry
from pipeline_steps.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SMOKE_ROWS = 8


def home() -> Path:
    return Path(os.environ.get("PIPELINE_HOME") or PROJECT_ROOT / ".demo")


def default_store() -> str:
    return os.environ.get("PIPELINE_STORE_URI") or f"file://{home() / 'store'}"


def run_key(run_id: str) -> str:
    """A run id as a safe path segment (run ids hold ':' and '+')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_")[:120] or "run"


def plan(params: dict, logical_date: datetime | None, run_id: str, dag_id: str) -> dict:
    from pipeline_steps import revisions

    exp = experiment.load(params.get("experiment") or "local_tiny")
    spec = exp.spec
    store = (params.get("store_uri") or default_store()).rstrip("/")
    work = str(Path(os.environ.get("PIPELINE_WORK_DIR") or home() / "work"))
    smoke = bool(params.get("smoke"))
    train_sets = list(params.get("datasets") or spec.get("datasets", {}).get("train") or [])
    eval_set = params.get("eval_dataset") or (spec.get("evaluation") or {}).get("dataset")
    pins = dict(params.get("dataset_revisions") or {})
    known = registry.load()
    items = []
    for name in dict.fromkeys(train_sets + ([eval_set] if eval_set else [])):
        if name not in known or not known[name].repo_id:
            raise UserError(f"dataset {name!r} is not a downloadable registry entry; choose from {sorted(k for k, v in known.items() if v.repo_id)}")
        if name in pins:
            revision, resolved = pins[name], {"source": "pinned"}
        elif logical_date is not None and params.get("revisions_as_of_logical_date", True):
            resolved = revisions.resolve(known[name].repo_id, logical_date)
            revision = resolved["commit"]
        else:
            revision, resolved = "main", {"source": "branch"}
        items.append({
            "dataset": name,
            "role": "eval" if name == eval_set and name not in train_sets else "train",
            "revision": revision,
            "resolved": resolved,
            "variant": params.get("variant") or "default",
            "limit": SMOKE_ROWS if smoke else None,
            "work": work,
            "store": store,
        })
    model = params.get("model") or (spec.get("model") or {}).get("source") or (spec.get("model") or {}).get("repo_id")
    model_revision = params.get("model_revision") or (spec.get("model") or {}).get("revision") or "main"
    key = run_key(run_id)
    return {
        "experiment": exp.name,
        "datasets": items,
        "model": {"args": ["--model", model, "--revision", model_revision, "--dest", store], "carry": {"model": model}},
        "store": store,
        "work": work,
        "run_key": key,
        "run_dir": f"{store}/runs/{exp.name}/{key}",
        "dag_id": dag_id,
        "run_id": run_id,
        "smoke": smoke,
    }


def download_request(item: dict) -> dict:
    return {"args": ["--dataset", item["dataset"], "--revision", item["revision"], "--dest", f"{item['work']}/snapshots"], "carry": item}


def preprocess_request(done: dict) -> dict:
    commit = done["download"]["commit"]
    tag = done["variant"] + (f"-limit{done['limit']}" if done.get("limit") else "")
    args = ["--dataset", done["dataset"], "--input", done["download"]["path"],
            "--output", f"{done['work']}/processed/{done['dataset']}/{commit}/{tag}", "--variant", done["variant"]]
    if done.get("limit"):
        args += ["--limit", str(done["limit"])]
    return {"args": args, "carry": done}


def upload_request(done: dict) -> dict:
    pp = done["preprocess"]
    dest = f"{done['store']}/datasets/{done['dataset']}/{done['download']['commit']}/{pp['content_hash'][:16]}"
    return {"args": ["--src", pp["output"], "--dest", dest], "carry": done}
