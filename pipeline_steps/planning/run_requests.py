"""The run-time requests: each step's argv as the plan recorded it (:mod:`.argv_templates`), filled in with what the
upstream tasks produced, and the run's inputs and lineage (:func:`collect`).

Each request is ``{"args": [...], "carry": {...}}`` for :class:`operators.step.PipelineStepOperator`; ``carry``
travels with a dataset through download -> preprocess -> upload so each mapped task knows what it is working on. A
plan without the argv of a step is refused (:meth:`~pipeline_steps.planning.run_plan.RunPlan.template`): every argv
is the plan's.

Cheap to import: the DAG files use these at parse time.
"""

from __future__ import annotations

import hashlib
import json

from pipeline_steps.errors import UserError
from pipeline_steps.planning import argv_templates as argv
from pipeline_steps.planning.run_plan import DatasetPlan, EvaluationPlan, RunPlan
from pipeline_steps.planning.run_plan import from_dict as plan_from_dict
from pipeline_steps.uris import strip_file_scheme


# -- a dataset's steps -------------------------------------------------------------------------------------------
def _template(item: dict, step: str) -> list[str]:
    """The argv the plan recorded for one dataset's step."""
    steps = DatasetPlan.from_dict(item).steps
    if step not in steps:
        raise UserError(f"plan dataset {item.get('dataset')!r}: no {step!r} step in it; re-run the DAG for a new plan")
    return steps[step]


def download_request(item: dict) -> dict:
    return {"args": argv.step_argv(_template(item, "download")), "carry": item}


def download_kwargs(item: dict) -> dict:
    """The mapped download task's arguments: its request, and the store whose connection's credentials the step gets
    (as every step that reads or writes the store): the run's store, which the snapshot is committed to, unless that
    is a ``file://`` store (no credentials) and a JSONL file is read from a bucket, which then needs them."""
    stored = [u for u in (item.get("files") or {}).values() if not u.startswith("hf://")]
    store = item["store"]
    return {
        "request": download_request(item),
        "store_uri": stored[0] if stored and store.startswith("file://") else store,
    }


def preprocess_request(done: dict) -> dict:
    facts = {"download_path": done["download"]["path"], "commit": done["download"]["commit"]}
    return {"args": argv.step_argv(_template(done, "preprocess"), facts), "carry": done}


def upload_request(done: dict) -> dict:
    facts = {
        "processed": done["preprocess"]["output"],
        "commit": done["download"]["commit"],
        "content_hash": done["preprocess"]["content_hash"][:16],
    }
    return {"args": argv.step_argv(_template(done, "upload"), facts), "carry": done}


# -- after the data is in the store ------------------------------------------------------------------------------
def _split_uri(done: dict, *preferred: str) -> str | None:
    splits = done["preprocess"]["splits"]
    for split in preferred:
        if split in splits:
            return f"{done['upload']['uri'].rstrip('/')}/{split}.parquet"
    return None


def lineage(uploaded: list[dict], staged: dict, run: RunPlan) -> dict:
    """The run's lineage (``lineage.json``, read by export for the model card): the base model, every dataset
    version with the snapshot it was made from, the experiment with its overrides, and the run."""
    model = staged["stage_model"]
    return {
        "base_model": {"name": staged["model"], "revision": model.get("revision"), "uri": model.get("uri")},
        "datasets": [
            {
                "name": d["dataset"],
                "role": d["role"],
                "repo_id": d["download"].get("repo_id"),
                "revision": d["download"]["commit"],
                "content_hash": d["preprocess"]["content_hash"],
                "uri": d["upload"]["uri"],
                "snapshot_uri": d["download"].get("snapshot_uri"),  # the raw snapshot the version was made from
                "resolved": d.get("resolved"),
                **({"files": d["download"]["sources"]} if d["download"].get("sources") else {}),
            }
            for d in uploaded
        ],
        "experiment": {
            "name": run.experiment,
            "preset_sha256": run.preset_sha256,
            "overrides": run.overrides,
            "overrides_sha256": hashlib.sha256(json.dumps(run.overrides).encode()).hexdigest(),
        },
        "dag_id": run.dag_id,
        "run_id": run.run_id,
        "run_uri": run.run_dir,
    }


def collect(uploaded: list[dict], staged: dict, run: dict) -> dict:
    """Training and evaluation inputs (store URIs) and the run's lineage, from what the upstream tasks produced and
    the run's plan."""
    plan = RunPlan.from_dict(run)
    val_names = set(plan.val_datasets)
    train = [d for d in uploaded if d["role"] == "train"]
    train_files = [u for d in train if (u := _split_uri(d, "train"))]
    val_files = [
        u for d in uploaded if d["dataset"] in val_names and (u := _split_uri(d, "test", "validation", "train"))
    ]
    # a training JSONL dataset's own validation file (the form's validation_jsonl) is validation data too
    val_files += [
        u
        for d in train
        if (d.get("files") or {}).get("validation") and (u := _split_uri(d, "validation")) and u not in val_files
    ]
    evals = [d for d in uploaded if d["dataset"] == plan.eval_dataset]
    eval_file = _split_uri(evals[0], "test", "validation", "train") if evals else None
    if not train_files:
        raise UserError("no training split among the processed datasets; add a dataset with a train split")
    return {
        "train_files": train_files,
        "val_files": val_files,
        "eval_file": eval_file,
        "eval_name": evals[0]["dataset"] if evals else None,
        "model_uri": staged["stage_model"]["uri"],
        "overrides": plan.overrides,
        "evaluation": plan.evaluation,
        "lineage": lineage(uploaded, staged, plan),
    }


# -- after training ----------------------------------------------------------------------------------------------
def evaluate_request(inputs: dict, trained: dict, run: dict) -> dict:
    """argv for the evaluate step: the plan's, with the checkpoint and the data filled in."""
    if not inputs.get("eval_file"):
        raise UserError("no evaluation set was processed; set eval_dataset or the preset's evaluation.dataset")
    facts = {
        "checkpoint": strip_file_scheme(trained["checkpoint_uri"]),
        "eval_file": strip_file_scheme(inputs["eval_file"]),
        "base_model": strip_file_scheme(inputs["model_uri"]),
    }
    return {"args": argv.step_argv(RunPlan.from_dict(run).template("evaluate"), facts), "carry": {}}


def export_request(inputs: dict, trained: dict, run: dict, evaluated: dict, lineage_file: str) -> dict:
    facts = {
        "checkpoint": strip_file_scheme(trained["checkpoint_uri"]),
        "lineage": lineage_file,
        "eval_results": evaluated["evaluate"]["results"],
        "base_results": evaluated["evaluate"]["base_results"],
    }
    return {"args": argv.step_argv(RunPlan.from_dict(run).template("export"), facts), "carry": {}}


def report_request(
    run: dict,
    trained: dict | None,
    exported: dict | None,
    dashboard_url: str | None,
    task_states: dict[str, str] | None = None,
) -> dict:
    """argv for the report step; upstream results may be missing (the report shows what exists), and the task
    states say what ran and what did not (with them the report accepts a run directory that was never made)."""
    facts = {
        "task_states": json.dumps(task_states, sort_keys=True) if task_states else None,
        "dashboard_url": str(dashboard_url) if dashboard_url else None,
        "exported_uri": (exported or {}).get("export", {}).get("uri") or None,
    }
    return {"args": argv.step_argv(RunPlan.from_dict(run).template("report"), facts), "carry": {}}


def train_local_argv(run: dict, facts: dict) -> list[str]:
    """The local backend's ``train-local`` argv as the plan recorded it (facts: ``plan_file``, ``train_files``,
    ``val_files``, ``model_path``, ``output_dir``: the local copies the train operator made)."""
    return ["train-local", *argv.step_argv(RunPlan.from_dict(run).template("train-local"), facts)]


def step_request(run: dict, step: str, facts: dict | None = None) -> dict:
    """``{"args": ..., "carry": {}}`` for a step whose argv the plan holds whole (the evaluation DAG's)."""
    plan = plan_from_dict(run)
    carry = plan.carry.get(step) if isinstance(plan, EvaluationPlan) else None
    return {"args": argv.step_argv(plan.template(step), facts), "carry": dict(carry or {})}
