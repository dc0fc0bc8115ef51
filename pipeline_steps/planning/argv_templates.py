"""Every step's argv, made by the plan: each step's flags are known here once.

An argv item the plan cannot know (a commit resolved by the download, a content hash, the checkpoint the training
wrote, the local copy of a store file) is a placeholder ``{@name}`` (:func:`fact`), filled in from upstream results
by :func:`step_argv` and nothing else (:mod:`pipeline_steps.planning.run_requests` and the train operator only supply
those facts). Every location comes from the run's :class:`~pipeline_steps.planning.layout.RunLayout`.

:data:`JOB_FLAGS` says, for each step run as a job (``PipelineStepJobOperator``), which of its flags carry store URIs
(pod paths on KubeRay; fetched into the local mirror on a cloud store) and which of those it writes (uploaded after
it): the DAG files take them from here (:func:`job_flags`).

Cheap to import: the DAG files use these at parse time.
"""

from __future__ import annotations

import json
import re

from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.uris import strip_file_scheme

FACT_RE = re.compile(r"\{@([a-z_]+)\}")

# step -> (flags whose values are store URIs, those of them the step writes)
JOB_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "evaluate": (
        ("--model", "--data", "--output", "--base-model", "--baseline-cache"),
        ("--output", "--baseline-cache"),
    ),
    "export": (("--checkpoint-dir", "--lineage", "--eval-results", "--base-results"), ()),
}


def job_flags(step: str) -> dict[str, tuple[str, ...]]:
    """``uri_args`` and ``output_args`` of the job operator that runs ``step``."""
    uris, outputs = JOB_FLAGS[step]
    return {"uri_args": uris, "output_args": outputs}


def fact(name: str) -> str:
    """The placeholder for a value known only once an upstream task has run (filled in by :func:`step_argv`)."""
    return "{@" + name + "}"


def step_argv(template: list[str], facts: dict | None = None) -> list[str]:
    """A step's argv as the plan recorded it, its placeholders filled in from ``facts``.

    An item that is a placeholder alone takes the fact's value: a list is spliced (``--train-files A B``); an empty
    value (None, "", []) drops the item and the ``--flag`` before it (an optional argument). A placeholder inside
    an item (``.../{@commit}/...``) is replaced by the fact's text. Every other item is passed as recorded.
    """
    facts = facts or {}

    def value(name: str):
        if name not in facts:
            raise ValueError(f"argv placeholder {fact(name)}: no value given for it (given: {sorted(facts)})")
        return facts[name]

    out: list[str] = []
    for item in map(str, template):
        whole = FACT_RE.fullmatch(item)
        if whole:
            v = value(whole.group(1))
            if v is None or v == "" or (isinstance(v, (list, tuple)) and not v):
                if out and out[-1].startswith("--"):
                    out.pop()
            elif isinstance(v, (list, tuple)):
                out.extend(str(x) for x in v)
            else:
                out.append(str(v))
        else:
            out.append(FACT_RE.sub(lambda m: str(value(m.group(1))), item))
    return out


# -- a dataset's steps -----------------------------------------------------------------------------------------
def _file_args(item: dict) -> list[str]:
    files = item.get("files") or {}
    return [
        a
        for split, flag in (("train", "--train-file"), ("validation", "--validation-file"))
        if split in files
        for a in (flag, files[split])
    ]


def dataset_steps(item: dict) -> dict[str, list[str]]:
    """One dataset's ``download``, ``preprocess`` and ``upload`` argv (facts: ``commit``, ``download_path``,
    ``processed``, ``content_hash``: what download and preprocess report)."""
    name = item["dataset"]
    layout = RunLayout.for_store(item["store"], work=item["work"])
    # tasks share nothing but the store: the snapshot is committed there (the version's raw lineage) and the
    # preprocessed output too, each read back by the next task wherever it runs; the work directory is a cache
    where = ["--dest", layout.snapshot_cache, "--store-dest", layout.snapshots]
    if item.get("files"):  # JSONL files: their revision is in the (pinned) Hub URI or their content
        download = ["--dataset", name, *_file_args(item), *where]
    else:
        download = ["--dataset", name, "--revision", item["revision"], *where]
    tag = item["variant"] + (f"-limit{item['limit']}" if item.get("limit") else "")
    preprocess = [
        "--dataset",
        name,
        "--input",
        fact("download_path"),
        "--output",
        layout.processed(name, fact("commit"), tag),
        "--variant",
        item["variant"],
        *_file_args(item),
    ]
    if item.get("limit"):
        preprocess += ["--limit", str(item["limit"])]
    upload = ["--src", fact("processed"), "--dest", layout.dataset_version(name, fact("commit"), fact("content_hash"))]
    return {"download": download, "preprocess": preprocess, "upload": upload}


# -- the run's later steps ---------------------------------------------------------------------------------------
def run_steps(run: dict) -> dict[str, list[str]]:
    """The run's later steps' argv: ``stage-model``, ``train-local`` (the local backend's training job; a kuberay
    run trains with verl's own entrypoint, rendered from the plan's preset), ``evaluate``, ``export``, ``report``."""
    layout = RunLayout(store=run["store"], run_dir=run["run_dir"], work=run["work"])
    steps = {"stage-model": list(run["model"]["args"])}
    if run["backend"] == "local":
        steps["train-local"] = [
            "--plan",
            fact("plan_file"),  # the preset and the overrides as planned (train-local reads no preset file)
            "--train-files",
            fact("train_files"),
            "--val-files",
            fact("val_files"),
            "--model-path",
            fact("model_path"),
            "--output-dir",
            fact("output_dir"),
        ]
    ev = run["evaluation"]
    steps["evaluate"] = evaluate_argv(layout, ev, run.get("eval_dataset"), run["backend"], smoke=run.get("smoke"))
    steps["export"] = export_argv(layout, ev, run["experiment"])
    steps["report"] = report_argv(layout)
    return steps


def report_argv(layout: RunLayout) -> list[str]:
    """The report step's argv (optional facts: ``task_states``, ``dashboard_url``, ``exported_uri``)."""
    return [
        "--run-dir",
        strip_file_scheme(layout.run_dir),
        "--task-states",
        fact("task_states"),
        "--dashboard-url",
        fact("dashboard_url"),
        "--exported-uri",
        fact("exported_uri"),
    ]


def _sampling(ev: dict) -> list[str]:
    return [
        "--k",
        str(ev.get("k", 4)),
        "--temperature",
        str(ev.get("temperature", 1.0)),
        "--top-p",
        str(ev.get("top_p", 1.0)),
        "--max-new-tokens",
        str(ev.get("max_new_tokens", 512)),
    ]


def evaluate_argv(layout: RunLayout, ev: dict, eval_name: str | None, backend: str, smoke: bool = False) -> list[str]:
    """The evaluate step's argv (facts: ``checkpoint``, ``eval_file``, ``base_model``); on the cluster it generates
    with vLLM on GPU."""
    args = [
        "--model",
        fact("checkpoint"),
        "--data",
        fact("eval_file"),
        *(["--name", eval_name] if eval_name else []),
        "--output",
        strip_file_scheme(layout.eval),
        "--base-model",
        fact("base_model"),
        "--baseline-cache",
        strip_file_scheme(layout.baseline_cache),  # shared by runs, and reachable from pods
        *_sampling(ev),
    ]
    if ev.get("mm_processor_kwargs"):
        args += ["--mm-processor-kwargs", json.dumps(ev["mm_processor_kwargs"], sort_keys=True)]
    if smoke:
        args += ["--max-problems", "4"]
    if backend == "kuberay":
        args += ["--generator", "vllm", "--tensor-parallel-size", str(ev.get("tensor_parallel_size", 1))]
    return args


def evaluate_model_argv(model: str, data: str, output: str, ev: dict) -> list[str]:
    """The ``verl_evaluate_model`` DAG's evaluate argv: a given model on given data, no baseline."""
    return [
        "--model",
        strip_file_scheme(model),
        "--data",
        strip_file_scheme(data),
        "--output",
        strip_file_scheme(output),
        *_sampling(ev),
    ]


def export_argv(layout: RunLayout, ev: dict, experiment: str) -> list[str]:
    """The export step's argv (facts: ``checkpoint``, ``lineage``, ``eval_results``, ``base_results``)."""
    args = [
        "--checkpoint-dir",
        fact("checkpoint"),
        "--output",
        layout.export_output,
        "--store-root",
        layout.store,
        "--experiment",
        experiment,
        "--lineage",
        fact("lineage"),
        "--eval-results",
        fact("eval_results"),
        "--base-results",
        fact("base_results"),
    ]
    if ev.get("collapse_margin") is not None:  # the preset's collapse check settings (on by default)
        args += ["--collapse-margin", str(ev["collapse_margin"])]
    if ev.get("collapse_check") is False:
        args += ["--no-collapse-check"]
    return args
