"""Make one pipeline run's plan from its parameters: which preset, backend, overrides, dataset revisions, model and
locations, and the argv of every later step.

The plan is made once, by the ``plan`` task (:func:`plan`): the preset is read, the backend resolved and the form's
overrides derived there, and the plan holds them (``preset``, ``preset_sha256``, ``backend``, ``overrides``, ``mounts``,
``evaluation``, every location) and the argv of every later step (``steps``, and each dataset's ``steps``, made by
:mod:`.argv_templates`). Every later task and operator reads the plan (its XCom, or ``plan.json`` in the run directory,
as a :class:`~pipeline_steps.planning.run_plan.RunPlan`) instead of deriving any of it from the form again, and every
step runs the argv the plan recorded (filled in by :mod:`.run_requests`).

The preset is carried whole (``preset``) with its hash (``preset_sha256``): a step given the plan
(``train-local --plan plan.json``) runs the preset as planned and ignores the preset file, so an edit of the file
after ``plan`` changes nothing in the run; a plan whose preset does not match its hash is refused
(:func:`pipeline_steps.training.experiment.from_plan`).

Every location is derived from the inputs (dataset, commit, variant, content hash, run id) by the run's
:class:`~pipeline_steps.planning.layout.RunLayout`, so a re-run or a backfill over an unchanged revision finds its
outputs already there and skips the work. Cheap to import: the DAG file uses it at parse time.
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
from pipeline_steps.planning.argv_templates import dataset_steps, run_steps
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.planning.run_plan import RunPlan
from pipeline_steps.store import parse_uri
from pipeline_steps.training import experiment
from pipeline_steps.training import overrides as override_rules

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
    layout = RunLayout.for_run(store, exp.name, key, work=work)
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
        "run_dir": layout.run_dir,
        "dag_id": dag_id,
        "run_id": run_id,
        "smoke": smoke,
    }
    run["steps"] = run_steps(run)
    return RunPlan.from_dict(run).to_dict()  # every key a later task reads, as it reads them
