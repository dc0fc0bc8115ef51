"""Plan one pipeline run from its parameters: which dataset revisions, which paths, which store locations.

The plan is made once, by the ``plan`` task (:func:`plan`): the preset is read, the backend resolved and the form's
overrides derived there, and the plan holds them (``preset``, ``preset_sha256``, ``backend``, ``overrides``, ``mounts``,
``evaluation``, every location). Every later task and operator reads the plan (its XCom, or ``plan.json`` in the run
directory) instead of deriving any of it from the form again.

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
    """A run id as a safe path segment (run ids hold ':' and '+')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_")[:120] or "run"


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
    the GPUs were granted: refused here, before any download. ``model.modalities`` in a preset (default text)."""
    modalities = experiment.modalities(spec)
    for name in used:
        ds = known.get(name)
        if ds is not None and ds.modality not in modalities:
            model = params.get("model") or (spec.get("model") or {}).get("source") or "its model"
            fitting = experiment.presets_reading(ds.modality)
            choose = f"choose a preset whose model.modalities include {ds.modality}"
            if fitting:
                choose = f"choose a preset that reads {ds.modality}s ({', '.join(fitting)})"
            raise UserError(
                f"dataset {name!r} has {ds.modality} rows but preset {preset!r} trains {model}, a "
                f"{'/'.join(sorted(modalities))}-only model; {choose}, or list {name!r} under prepare_datasets to "
                "prepare it without training on it"
            )


def preset_settings(params: dict) -> tuple[experiment.Experiment, dict]:
    """The run's experiment (its preset read once, with the form's overrides) and what the plan keeps of it: the
    preset as read, its hash, the backend, the overrides, the evaluation settings and the datasets it names."""
    # every override parsed and checked now (one line in the plan task's log), not minutes later in pre-flight
    for text in params.get("verl_overrides") or []:
        override_rules.check_form(*experiment.parse_override(text), f"verl_overrides {text[:80]!r}")
    preset = experiment.read(params.get("experiment") or "local_tiny")  # the run's one read of its preset
    run_overrides = form.overrides(params)  # the form's fields and free-form overrides, as verl overrides
    exp = experiment.merged(preset, run_overrides)
    spec = exp.spec
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
        if model != "tiny" and not MODEL_REPO_RE.match(model):
            raise UserError(
                f"model {model!r}: expected a Hugging Face repo id such as Qwen/Qwen2.5-3B-Instruct, or tiny"
            )
        # the preset's revision belongs to the preset's model: a form model without a revision is staged at main
        model_revision = params.get("model_revision") or "main"
    else:
        model = preset_model.get("source") or preset_model.get("repo_id")
        model_revision = params.get("model_revision") or preset_model.get("revision") or "main"
    key = run_key(run_id)
    return {
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


def _file_args(item: dict) -> list[str]:
    files = item.get("files") or {}
    return [
        a
        for split, flag in (("train", "--train-file"), ("validation", "--validation-file"))
        if split in files
        for a in (flag, files[split])
    ]


def download_request(item: dict) -> dict:
    if item.get("files"):  # JSONL files: their revision is in the (pinned) Hub URI or their content
        args = ["--dataset", item["dataset"], *_file_args(item), "--dest", f"{item['work']}/snapshots"]
    else:
        args = ["--dataset", item["dataset"], "--revision", item["revision"], "--dest", f"{item['work']}/snapshots"]
    return {"args": args, "carry": item}


def download_kwargs(item: dict) -> dict:
    """The mapped download task's arguments: its request, and the store a store file is read from (its connection's
    credentials go to the step, as for every step that reads the store); empty for Hub downloads."""
    stored = [u for u in (item.get("files") or {}).values() if not u.startswith("hf://")]
    return {"request": download_request(item), "store_uri": stored[0] if stored else ""}


def preprocess_request(done: dict) -> dict:
    commit = done["download"]["commit"]
    tag = done["variant"] + (f"-limit{done['limit']}" if done.get("limit") else "")
    args = [
        "--dataset",
        done["dataset"],
        "--input",
        done["download"]["path"],
        "--output",
        f"{done['work']}/processed/{done['dataset']}/{commit}/{tag}",
        "--variant",
        done["variant"],
        *_file_args(done),
    ]
    if done.get("limit"):
        args += ["--limit", str(done["limit"])]
    return {"args": args, "carry": done}


def upload_request(done: dict) -> dict:
    pp = done["preprocess"]
    dest = f"{done['store']}/datasets/{done['dataset']}/{done['download']['commit']}/{pp['content_hash'][:16]}"
    return {"args": ["--src", pp["output"], "--dest", dest], "carry": done}


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
    """argv for the evaluate step; on the cluster it generates with vLLM on GPU (backend: the plan's by default)."""
    backend = backend or run.get("backend") or "local"
    ev = inputs["evaluation"]
    if not inputs.get("eval_file"):
        raise UserError("no evaluation set was processed; set eval_dataset or the preset's evaluation.dataset")
    args = [
        "--model",
        strip_file_scheme(trained["checkpoint_uri"]),
        "--data",
        strip_file_scheme(inputs["eval_file"]),
        *(["--name", inputs["eval_name"]] if inputs.get("eval_name") else []),
        "--output",
        strip_file_scheme(f"{run['run_dir']}/eval"),
        "--base-model",
        strip_file_scheme(inputs["model_uri"]),
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
    return {"args": args, "carry": {}}


def export_request(inputs: dict, trained: dict, run: dict, evaluated: dict, lineage_file: str) -> dict:
    args = [
        "--checkpoint-dir",
        strip_file_scheme(trained["checkpoint_uri"]),
        "--output",
        f"{run['work']}/export/{run['run_key']}",
        "--store-root",
        run["store"],
        "--experiment",
        run["experiment"],
        "--lineage",
        lineage_file,
        "--eval-results",
        evaluated["evaluate"]["results"],
        "--base-results",
        evaluated["evaluate"]["base_results"],
    ]
    ev = inputs.get("evaluation") or {}  # the preset's collapse check settings (on by default)
    if ev.get("collapse_margin") is not None:
        args += ["--collapse-margin", str(ev["collapse_margin"])]
    if ev.get("collapse_check") is False:
        args += ["--no-collapse-check"]
    return {"args": args, "carry": {}}


def report_request(
    run: dict,
    trained: dict | None,
    exported: dict | None,
    dashboard_url: str | None,
    task_states: dict[str, str] | None = None,
) -> dict:
    """argv for the report step; upstream results may be missing (the report shows what exists), and the task
    states say what ran and what did not (with them the report accepts a run directory that was never made)."""
    args = ["--run-dir", strip_file_scheme(run["run_dir"])]
    if task_states:
        args += ["--task-states", json.dumps(task_states, sort_keys=True)]
    if dashboard_url:
        args += ["--dashboard-url", str(dashboard_url)]
    if exported and exported.get("export", {}).get("uri"):
        args += ["--exported-uri", exported["export"]["uri"]]
    return {"args": args, "carry": {}}


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
    from pipeline_steps.store import open_store

    uri = f"{run_dir.rstrip('/')}/{PLAN_FILE}"
    data = open_store(uri).read_bytes(uri)
    if data is None:
        raise UserError(f"{uri}: no plan there; the run's plan task writes it first")
    return json.loads(data)
