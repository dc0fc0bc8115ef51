"""Plan one pipeline run from its parameters: which dataset revisions, which paths, which store locations.

The plan is made once, by the ``plan`` task (:func:`plan`): the preset is read, the backend resolved and the form's
overrides derived there, and the plan holds them (``preset``, ``preset_sha256``, ``backend``, ``overrides``, ``mounts``,
``evaluation``, every location) and the argv of every later step (``steps``, and each dataset's ``steps``: see
:func:`step_argv`). Every later task and operator reads the plan (its XCom, or ``plan.json`` in the run directory)
instead of deriving any of it from the form again, and every step runs the argv the plan recorded.

An argv item the plan cannot know (a commit resolved by the download, a content hash, the checkpoint the training
wrote, the local copy of a store file) is a placeholder ``{@name}`` (:func:`fact`), filled in from upstream results
by :func:`step_argv` and nothing else: the request functions below and the train operator only supply those facts.

The preset is carried whole (``preset``) with its hash (``preset_sha256``): a step given the plan
(``train-local --plan plan.json``) runs the preset as planned and ignores the preset file, so an edit of the file
after ``plan`` changes nothing in the run; a plan whose preset does not match its hash is refused
(:func:`pipeline_steps.training.experiment.from_plan`).

Every location is derived from the inputs (dataset, commit, variant, content hash, run id), so a re-run or a
backfill over an unchanged revision finds its outputs already there and skips the work. Each function returns
``{"args": [...], "carry": {...}}`` for :class:`operators.step.PipelineStepOperator`; ``carry`` travels with a
dataset through download -> preprocess -> upload so each mapped task knows what it is working on.
Cheap to import: the DAG file uses these at parse time.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.data import registry
from pipeline_steps.errors import UserError
from pipeline_steps.planning import form
from pipeline_steps.store import parse_uri
from pipeline_steps.training import experiment
from pipeline_steps.training import overrides as override_rules
from pipeline_steps.uris import strip_file_scheme

SMOKE_ROWS = 8
MODEL_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def default_store() -> str:
    return settings.get(settings.STORE_URI) or f"file://{settings.home() / 'store'}"


def run_key(run_id: str) -> str:
    """A run id as a safe path segment: its readable part (run ids hold ':' and '+', folded to '_') and a short hash
    of the whole id, so distinct ids (``nightly:1`` and ``nightly_1``, two long ids with one prefix) never share a
    run directory, and the same id (a retry) always finds its own again."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_.")[:100] or "run"
    return f"{readable}-{hashlib.sha256(run_id.encode()).hexdigest()[:10]}"


def _backend(params: dict, spec: dict) -> str:
    """The run's backend: the form's, else the preset's (resolved here once; the plan holds it)."""
    from pipeline_steps.constants import resolve_backend

    try:
        return resolve_backend(params.get("backend"), spec.get("backend"))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _check_store_reaches_the_pods(backend: str, spec: dict, store: str) -> list[dict]:
    """A kuberay run reads and writes the store through the Ray pods' bucket mounts: refuse, in one line, a store
    that is on none of them (a file:// store on the worker's disk, another bucket) before anything is downloaded.
    Returns the pods' mounts (``uri``, ``path``; none for the local backend)."""
    from pipeline_steps.training.mounts import MountMap

    if backend != "kuberay":
        return []
    mounts = MountMap.for_experiment(spec)
    if not mounts.find(store):
        where = ", ".join(m.uri for m in mounts.mounts) or "none configured"
        raise UserError(
            f"store_uri {store}: the kuberay backend reaches the store through the pods' bucket mounts, and this "
            f"store is on none of them (mounts: {where}); use a mounted bucket or the local backend"
        )
    return [{"uri": m.uri, "path": m.path} for m in mounts.mounts]


def _form_file_dataset(params: dict) -> registry.DatasetSpec | None:
    """The trigger form's JSONL files (``train_jsonl``, optional ``validation_jsonl``) as a registry spec."""
    train, validation = params.get("train_jsonl"), params.get("validation_jsonl")
    if validation and not train:
        raise UserError(
            f"validation_jsonl {str(validation)[:200]!r}: set train_jsonl too (the training file); a validation file "
            "alone gives nothing to train on"
        )
    if not train:
        return None
    return registry.file_spec(train, validation, what=("train_jsonl", "validation_jsonl"))


def _pinned_files(ds: registry.DatasetSpec, as_of: datetime | None) -> tuple[dict, str, dict]:
    """A JSONL dataset's files with every unpinned Hub file pinned to its repository's newest commit at ``as_of`` (as
    registry datasets are), the revision to show (the train file's Hub revision; ``content`` for a store file, whose
    version the download step derives from its bytes) and how it was resolved."""
    import dataclasses

    from pipeline_steps.data import revisions

    files = {"train": ds.train_file, **({"validation": ds.validation_file} if ds.validation_file else {})}
    revision, resolved = "content", {"source": "content"}
    for split, uri in files.items():
        if not uri.startswith("hf://"):
            continue
        parsed = registry.hub_file(uri, f"{split} file")
        if parsed.revision:
            rev, how = parsed.revision, {"source": "pinned"}
        elif as_of is not None:
            how = revisions.resolve(parsed.id, as_of)
            rev = how["commit"]
            files[split] = dataclasses.replace(parsed, revision=rev).to_uri()
        else:
            rev, how = "main", {"source": "branch"}
        if split == "train":
            revision, resolved = rev, how
    return files, revision, resolved


def _check_modalities(spec: dict, preset: str, params: dict, known: dict, used: list[str]) -> None:
    """Image rows through a text-only model would stop verl at job start (its dataset asserts a processor), after
    the GPUs were granted: refused here, before any download. What the model reads comes from the model
    (:func:`experiment.model_modalities`: a local build, its config.json, the preset's declaration, known
    architectures), and the refusal says which."""
    model = (params.get("model") or "").strip() or None
    revision = params.get("model_revision") or (None if model else (spec.get("model") or {}).get("revision"))
    modalities, how = experiment.model_modalities(spec, model, revision)
    for name in used:
        ds = known.get(name)
        if ds is not None and ds.modality not in modalities:
            model_name = model or (spec.get("model") or {}).get("source") or "its model"
            fitting = experiment.presets_reading(ds.modality)
            choose = f"choose a model or preset that reads {ds.modality}s"
            if fitting:
                choose = f"choose a preset that reads {ds.modality}s ({', '.join(fitting)})"
            raise UserError(
                f"dataset {name!r} has {ds.modality} rows but preset {preset!r} trains {model_name}, a "
                f"{'/'.join(sorted(modalities))}-only model ({how}); {choose}, or list {name!r} under "
                "prepare_datasets to prepare it without training on it"
            )


def preset_settings(params: dict) -> tuple[experiment.Experiment, dict]:
    """The run's experiment (its preset read once, with the form's overrides) and what the plan keeps of it: the
    preset as read, its hash, the backend, the overrides, the evaluation settings and the datasets it names."""
    form.check_params(params)  # sizes of every string, list and mapping, numeric fields' ranges: before any parse
    # every override parsed and checked now (one line in the plan task's log), not minutes later in pre-flight: only
    # the keys of the reviewed table (pipeline_steps/training/form_keys.py), each within its type and range
    for text in params.get("verl_overrides") or []:
        override_rules.check_form(*experiment.parse_override(text), f"verl_overrides {text[:80]!r}")
    preset = experiment.read(params.get("experiment") or "local_tiny")  # the run's one read of its preset
    experiment.check_offered(preset)  # a preset the form does not offer (form: false) is not run by the DAG either
    run_overrides = form.overrides(params)  # the form's fields and free-form overrides, as verl overrides
    exp = experiment.merged(preset, run_overrides)
    spec = exp.spec
    preset_model = (spec.get("model") or {}).get("source") or (spec.get("model") or {}).get("repo_id")
    form_model = str(params["model"]).strip() if params.get("model") else None
    override_rules.check_form_model(exp.verl, form_model, preset_model, f"preset {exp.name!r}")
    evaluation = dict(spec.get("evaluation") or {})
    # the evaluate job gets one worker with all of a node's GPUs: vLLM shards the model over them
    gpus = params.get("gpus_per_node") or (spec.get("cluster") or {}).get("gpus_per_node") or 1
    evaluation.setdefault("tensor_parallel_size", int(gpus))
    # the figures' pixel limits of training (the preset's, or the form's overrides) hold for its evaluation too
    mm = experiment.mm_processor_kwargs(exp.verl)
    if mm:
        evaluation.setdefault("mm_processor_kwargs", mm)
    return exp, {
        "experiment": exp.name,
        # the preset as read (JSON types: the plan travels as XCom and plan.json), and what else the run derives
        "preset": json.loads(json.dumps({"name": preset.name, "spec": preset.spec, "verl": preset.verl}, default=str)),
        "preset_sha256": preset.digest(),
        "backend": _backend(params, spec),
        "overrides": run_overrides,
        "evaluation": evaluation,
        "eval_dataset": params.get("eval_dataset") or (spec.get("evaluation") or {}).get("dataset"),
        "val_datasets": list((spec.get("datasets") or {}).get("val") or []),
    }


def plan(params: dict, logical_date: datetime | None, run_id: str, dag_id: str) -> dict:
    """The run's plan, made once: every later task reads it (XCom, or ``plan.json`` in the run directory)."""
    from pipeline_steps.data import revisions

    exp, planned = preset_settings(params)
    spec = exp.spec
    store = (params.get("store_uri") or default_store()).rstrip("/")
    parse_uri(store)  # file:// needs an absolute path, buckets a valid name: one line naming the URI otherwise
    work = str(settings.get_path(settings.WORK_DIR, settings.home() / "work"))
    smoke = bool(params.get("smoke"))
    known = registry.load()
    # a JSONL file chosen in the form (store or Hub URI) is a dataset of its own, trained on instead of the preset's
    # train sets (alongside the form's "datasets" when those are given too)
    file_set = _form_file_dataset(params)
    preset_train = [] if file_set else spec.get("datasets", {}).get("train") or []
    train_sets = list(params.get("datasets") or preset_train)
    if file_set:
        known[file_set.name] = file_set
        train_sets = list(dict.fromkeys([*train_sets, file_set.name]))
    eval_set = planned["eval_dataset"]
    pins = dict(params.get("dataset_revisions") or {})
    # a tool-agent preset names its row variant (datasets.variant); the form's choice wins unless left at default
    variant = params.get("variant") or "default"
    if variant == "default":
        variant = (spec.get("datasets") or {}).get("variant") or "default"
    _check_modalities(spec, exp.name, params, known, train_sets + ([eval_set] if eval_set else []))
    mounts = _check_store_reaches_the_pods(planned["backend"], spec, store)
    items = []
    extra_sets = list(params.get("prepare_datasets") or [])
    selected = list(dict.fromkeys(train_sets + ([eval_set] if eval_set else []) + extra_sets))
    stray = sorted(set(pins) - set(selected))
    if stray:  # a misspelt or unselected pin would leave the dataset it meant unpinned
        raise UserError(
            f"dataset_revisions: {stray} not among this run's datasets {selected}; fix the name or select the dataset"
        )
    as_of = logical_date if logical_date is not None and params.get("revisions_as_of_logical_date", True) else None
    for name in selected:
        ds = known.get(name)
        if ds is None or not (ds.repo_id or ds.train_file):
            raise UserError(
                f"dataset {name!r} is not a downloadable registry entry; choose from "
                f"{sorted(k for k, v in known.items() if v.repo_id or v.train_file)}, or name a JSONL file in "
                "train_jsonl"
            )
        files = None
        if ds.train_file:
            if name in pins:
                raise UserError(
                    f"dataset_revisions: {name!r} is made of JSONL files; pin a Hub file's revision in its URI "
                    "(hf://datasets/<org>/<name>@<revision>/<path>.jsonl); a store file's version is its content"
                )
            files, revision, resolved = _pinned_files(ds, as_of)
        elif name in pins:
            revision, resolved = pins[name], {"source": "pinned"}
        elif as_of is not None:
            resolved = revisions.resolve(ds.repo_id, as_of)
            revision = resolved["commit"]
        else:
            revision, resolved = "main", {"source": "branch"}
        item = {
            "dataset": name,
            "role": "train" if name in train_sets else "eval" if name == eval_set else "prepare",
            "revision": revision,
            "resolved": resolved,
            "variant": variant,
            "limit": SMOKE_ROWS if smoke else None,
            "work": work,
            "store": store,
        }
        if files:
            item["files"] = files  # {"train": uri, "validation": uri}: what download reads (Hub URIs pinned)
        items.append(item)
    preset_model = spec.get("model") or {}
    if params.get("model"):  # typed in the form: a Hub repo id (or tiny), never a path on the worker
        model = str(params["model"]).strip()
        if model not in experiment.LOCAL_BUILDS and not MODEL_REPO_RE.match(model):
            raise UserError(
                f"model {model!r}: expected a Hugging Face repo id such as Qwen/Qwen2.5-3B-Instruct, or one of the "
                f"local builds {', '.join(experiment.LOCAL_BUILDS)}"
            )
        # the preset's revision belongs to the preset's model: a form model without a revision is staged at main
        model_revision = params.get("model_revision") or "main"
    else:
        model = preset_model.get("source") or preset_model.get("repo_id")
        model_revision = params.get("model_revision") or preset_model.get("revision") or "main"
    key = run_key(run_id)
    for item in items:  # each dataset's download, preprocess and upload, as they will run
        item["steps"] = dataset_steps(item)
    run = {
        **planned,
        "mounts": mounts,  # the pods' bucket mounts (kuberay)
        "datasets": items,
        "model": {
            "args": ["--model", model, "--revision", model_revision, "--dest", store, "--hub-only"],
            "carry": {"model": model},
        },
        "store": store,
        "work": work,
        "run_key": key,
        "run_dir": f"{store}/runs/{exp.name}/{key}",
        "dag_id": dag_id,
        "run_id": run_id,
        "smoke": smoke,
    }
    run["steps"] = run_steps(run)
    return run


# -- every step's argv, made by the plan ---------------------------------------------------------------------
FACT_RE = re.compile(r"\{@([a-z_]+)\}")


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


def dataset_steps(item: dict) -> dict[str, list[str]]:
    """One dataset's ``download``, ``preprocess`` and ``upload`` argv (facts: ``commit``, ``download_path``,
    ``processed``, ``content_hash``: what download and preprocess report)."""
    name, work, store = item["dataset"], item["work"], item["store"]
    # tasks share nothing but the store: the snapshot is committed there (the version's raw lineage) and the
    # preprocessed output too, each read back by the next task wherever it runs; the work directory is a cache
    where = ["--dest", f"{work}/snapshots", "--store-dest", f"{store}/snapshots"]
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
        f"{store}/cache/processed/{name}/{fact('commit')}/{tag}",
        "--variant",
        item["variant"],
        *_file_args(item),
    ]
    if item.get("limit"):
        preprocess += ["--limit", str(item["limit"])]
    upload = [
        "--src",
        fact("processed"),
        "--dest",
        f"{item['store']}/datasets/{name}/{fact('commit')}/{fact('content_hash')}",
    ]
    return {"download": download, "preprocess": preprocess, "upload": upload}


def run_steps(run: dict) -> dict[str, list[str]]:
    """The run's later steps' argv: ``stage-model``, ``train-local`` (the local backend's training job; a kuberay
    run trains with verl's own entrypoint, rendered from the plan's preset), ``evaluate``, ``export``, ``report``."""
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
    steps["evaluate"] = evaluate_argv(run, run["evaluation"], run.get("eval_dataset"), run["backend"])
    steps["export"] = export_argv(run, run["evaluation"])
    steps["report"] = report_argv(run)
    return steps


def report_argv(run: dict) -> list[str]:
    """The report step's argv (optional facts: ``task_states``, ``dashboard_url``, ``exported_uri``)."""
    return [
        "--run-dir",
        strip_file_scheme(run["run_dir"]),
        "--task-states",
        fact("task_states"),
        "--dashboard-url",
        fact("dashboard_url"),
        "--exported-uri",
        fact("exported_uri"),
    ]


def evaluate_argv(run: dict, ev: dict, eval_name: str | None, backend: str) -> list[str]:
    """The evaluate step's argv (facts: ``checkpoint``, ``eval_file``, ``base_model``); on the cluster it generates
    with vLLM on GPU."""
    args = [
        "--model",
        fact("checkpoint"),
        "--data",
        fact("eval_file"),
        *(["--name", eval_name] if eval_name else []),
        "--output",
        strip_file_scheme(f"{run['run_dir']}/eval"),
        "--base-model",
        fact("base_model"),
        "--baseline-cache",
        strip_file_scheme(f"{run['store']}/cache/baseline"),  # shared by runs, and reachable from pods
        "--k",
        str(ev.get("k", 4)),
        "--temperature",
        str(ev.get("temperature", 1.0)),
        "--top-p",
        str(ev.get("top_p", 1.0)),
        "--max-new-tokens",
        str(ev.get("max_new_tokens", 512)),
    ]
    if ev.get("mm_processor_kwargs"):
        args += ["--mm-processor-kwargs", json.dumps(ev["mm_processor_kwargs"], sort_keys=True)]
    if run.get("smoke"):
        args += ["--max-problems", "4"]
    if backend == "kuberay":
        args += ["--generator", "vllm", "--tensor-parallel-size", str(ev.get("tensor_parallel_size", 1))]
    return args


def export_argv(run: dict, ev: dict) -> list[str]:
    """The export step's argv (facts: ``checkpoint``, ``lineage``, ``eval_results``, ``base_results``)."""
    args = [
        "--checkpoint-dir",
        fact("checkpoint"),
        "--output",
        f"{run['work']}/export/{run['run_key']}",
        "--store-root",
        run["store"],
        "--experiment",
        run["experiment"],
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


def _file_args(item: dict) -> list[str]:
    files = item.get("files") or {}
    return [
        a
        for split, flag in (("train", "--train-file"), ("validation", "--validation-file"))
        if split in files
        for a in (flag, files[split])
    ]


def download_request(item: dict) -> dict:
    return {"args": step_argv(_dataset_template(item, "download")), "carry": item}


def _dataset_template(item: dict, step: str) -> list[str]:
    """The argv the plan recorded for one dataset's step (made here for an item planned without them)."""
    return (item.get("steps") or dataset_steps(item))[step]


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
    return {"args": step_argv(_dataset_template(done, "preprocess"), facts), "carry": done}


def upload_request(done: dict) -> dict:
    facts = {
        "processed": done["preprocess"]["output"],
        "commit": done["download"]["commit"],
        "content_hash": done["preprocess"]["content_hash"][:16],
    }
    return {"args": step_argv(_dataset_template(done, "upload"), facts), "carry": done}


# -- after the data is in the store ------------------------------------------------------------------------
def _split_uri(done: dict, *preferred: str) -> str | None:
    splits = done["preprocess"]["splits"]
    for split in preferred:
        if split in splits:
            return f"{done['upload']['uri'].rstrip('/')}/{split}.parquet"
    return None


def collect(uploaded: list[dict], staged: dict, run: dict) -> dict:
    """Training and evaluation inputs (store URIs) and the run's lineage, from what the upstream tasks produced and
    the run's plan."""
    val_names = set(run["val_datasets"])
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
    evals = [d for d in uploaded if d["dataset"] == run["eval_dataset"]]
    eval_file = _split_uri(evals[0], "test", "validation", "train") if evals else None
    if not train_files:
        raise UserError("no training split among the processed datasets; add a dataset with a train split")
    model = staged["stage_model"]
    lineage = {
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
            "name": run["experiment"],
            "preset_sha256": run["preset_sha256"],
            "overrides": run["overrides"],
            "overrides_sha256": hashlib.sha256(json.dumps(run["overrides"]).encode()).hexdigest(),
        },
        "dag_id": run["dag_id"],
        "run_id": run["run_id"],
        "run_uri": run["run_dir"],
    }
    return {
        "train_files": train_files,
        "val_files": val_files,
        "eval_file": eval_file,
        "eval_name": evals[0]["dataset"] if evals else None,
        "model_uri": model["uri"],
        "overrides": run["overrides"],
        "evaluation": run["evaluation"],
        "lineage": lineage,
    }


def evaluate_request(inputs: dict, trained: dict, run: dict, backend: str | None = None) -> dict:
    """argv for the evaluate step: the plan's, with the checkpoint and the data filled in (``backend``: another
    backend's argv than the plan's, for a plan made without them)."""
    if not inputs.get("eval_file"):
        raise UserError("no evaluation set was processed; set eval_dataset or the preset's evaluation.dataset")
    template = (run.get("steps") or {}).get("evaluate")
    if template is None or (backend and backend != run.get("backend")):
        template = evaluate_argv(run, inputs["evaluation"], inputs.get("eval_name"), backend or run.get("backend"))
    facts = {
        "checkpoint": strip_file_scheme(trained["checkpoint_uri"]),
        "eval_file": strip_file_scheme(inputs["eval_file"]),
        "base_model": strip_file_scheme(inputs["model_uri"]),
    }
    return {"args": step_argv(template, facts), "carry": {}}


def export_request(inputs: dict, trained: dict, run: dict, evaluated: dict, lineage_file: str) -> dict:
    template = (run.get("steps") or {}).get("export") or export_argv(run, inputs.get("evaluation") or {})
    facts = {
        "checkpoint": strip_file_scheme(trained["checkpoint_uri"]),
        "lineage": lineage_file,
        "eval_results": evaluated["evaluate"]["results"],
        "base_results": evaluated["evaluate"]["base_results"],
    }
    return {"args": step_argv(template, facts), "carry": {}}


def report_request(
    run: dict,
    trained: dict | None,
    exported: dict | None,
    dashboard_url: str | None,
    task_states: dict[str, str] | None = None,
) -> dict:
    """argv for the report step; upstream results may be missing (the report shows what exists), and the task
    states say what ran and what did not (with them the report accepts a run directory that was never made)."""
    template = (run.get("steps") or {}).get("report") or report_argv(run)
    facts = {
        "task_states": json.dumps(task_states, sort_keys=True) if task_states else None,
        "dashboard_url": str(dashboard_url) if dashboard_url else None,
        "exported_uri": (exported or {}).get("export", {}).get("uri") or None,
    }
    return {"args": step_argv(template, facts), "carry": {}}


def train_local_argv(run: dict, facts: dict) -> list[str]:
    """The local backend's ``train-local`` argv as the plan recorded it (facts: ``plan_file``, ``train_files``,
    ``val_files``, ``model_path``, ``output_dir``: the local copies the train operator made)."""
    template = (run.get("steps") or {}).get("train-local")
    if template is None:
        raise UserError("the run's plan has no train-local step (planned for another backend); re-run plan")
    return ["train-local", *step_argv(template, facts)]


def step_request(run: dict, step: str, facts: dict | None = None) -> dict:
    """``{"args": ..., "carry": {}}`` for a step whose argv the plan holds whole (the evaluation DAG's)."""
    return {"args": step_argv(run["steps"][step], facts), "carry": dict((run.get("carry") or {}).get(step) or {})}


# -- the verl_evaluate_model DAG's plan ---------------------------------------------------------------------
def evaluation_plan(params: dict, triggered_by: str | None, run_id: str, dag_id: str) -> dict:
    """The ``verl_evaluate_model`` run's plan, made once by its ``plan`` task: which model (the form's, else the
    exported model whose event triggered the run), which evaluation parquet (the form's, else the named dataset's
    last processed version in the store), where the results go, and the evaluate step's argv (``steps``). The store
    is opened as every step opens it (the caller's connection in the environment)."""
    from pipeline_steps.store import open_store

    store = (params.get("store_uri") or default_store()).rstrip("/")
    model = params.get("model_uri") or triggered_by or ""
    if not model:
        raise UserError("model_uri: empty and no exported-model event triggered this run; name a model to evaluate")
    data = params.get("eval_data_uri")
    if not data:
        name = params["eval_dataset"]
        pointer = open_store(store).read_bytes(f"{store}/datasets/{name}/last_processed.json")
        if pointer is None:
            raise UserError(
                f"eval_dataset {name!r}: no processed version in {store}; run verl_grpo_pipeline with it first or "
                "pass eval_data_uri"
            )
        data = json.loads(pointer)["uri"].rstrip("/") + "/test.parquet"
    key = run_key(run_id)
    evaluate = [
        "--model",
        strip_file_scheme(model),
        "--data",
        strip_file_scheme(data),
        "--output",
        strip_file_scheme(f"{store}/evaluations/{key}"),  # in the store: the results outlive the task's machine
        "--k",
        str(params["k"]),
        "--temperature",
        str(params["temperature"]),
        "--top-p",
        str(params["top_p"]),
        "--max-new-tokens",
        str(params["max_new_tokens"]),
    ]
    return {
        "backend": "local",  # in the worker; a model and data on a cloud store are fetched into its local mirror
        "store": store,
        "model": model,
        "data": data,
        "run_key": key,
        "dag_id": dag_id,
        "run_id": run_id,
        "steps": {"evaluate": evaluate},
        "carry": {"evaluate": {"model": model, "data": data}},  # in the evaluate task's XCom, as before
    }


PLAN_FILE = "plan.json"


def save(run: dict) -> str:
    """Write the plan to ``plan.json`` in the run directory (one atomic write: a reader sees all of it or none);
    returns its URI. The store is opened as every step opens it (its environment: the caller's connection)."""
    from pipeline_steps.store import open_store

    uri = f"{run['run_dir']}/{PLAN_FILE}"
    open_store(run["store"]).write_bytes(uri, json.dumps(run, indent=2, sort_keys=True).encode())
    return uri


def load(run_dir: str) -> dict:
    """The plan a run's ``plan`` task wrote to its run directory."""
    return load_file(f"{run_dir.rstrip('/')}/{PLAN_FILE}")


def experiment_from_file(path_or_uri: str, overrides: list[str] | None = None, derived: dict | None = None):
    """The run's experiment from its ``plan.json`` (a step's ``--plan``): the preset as planned, no preset file
    read; a step's own ``--override`` would change the planned run, so it is refused."""
    from pipeline_steps.training import experiment

    if overrides:
        raise UserError("--override: a plan holds its run's overrides; pass --experiment to add your own")
    return experiment.from_plan(load_file(path_or_uri), derived)


def load_file(path_or_uri: str) -> dict:
    """A plan from its ``plan.json`` (a local path, or a store URI); a step given ``--plan`` reads it here."""
    from pipeline_steps.store import open_store

    uri = str(path_or_uri) if "://" in str(path_or_uri) else f"file://{Path(path_or_uri).resolve()}"
    data = open_store(uri).read_bytes(uri)
    if data is None:
        raise UserError(f"{uri}: no plan there; the run's plan task writes it first")
    try:
        run = json.loads(data)
    except ValueError:
        raise UserError(f"{uri}: not a plan (invalid JSON)") from None
    if not isinstance(run, dict) or not isinstance(run.get("preset"), dict):
        raise UserError(f"{uri}: not a run plan (no preset in it); pass the plan.json the plan task wrote")
    return run
