"""Known datasets: which Hub repository (or which JSONL files), which files, which preprocessor.

Users add their own without code: a YAML or JSON file named by ``--registry`` or
``$PIPELINE_DATASETS`` holding ``{name: {repo_id, preprocessor, ...}}`` entries
(the same fields as :class:`DatasetSpec`); they are merged over the built-ins.

A dataset may also be one JSONL file (plus an optional validation file) named by URI instead of a Hub repository:
a store object (``file:///abs/x.jsonl``, ``oss://bucket/key.jsonl``, ``gs://bucket/key.jsonl``) or a Hub dataset
file (``hf://datasets/<org>/<name>[@<revision>]/<path>.jsonl``, huggingface_hub's ``HfFileSystem`` spelling). A
registry entry names them in ``train_file``/``validation_file``; the trigger form's JSONL fields become such a spec
through :func:`file_spec` (name derived from the file, :func:`file_dataset_name`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.data.preprocessors import preprocessor_names
from pipeline_steps.errors import UserError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo_id: str
    preprocessor: str  # a name registered with @register_preprocessor (pipeline_steps/data/preprocessors/)
    config: str | None = None  # the repository's subset folder (gsm8k: "main")
    allow_patterns: tuple[str, ...] = ()  # files to download; empty means all
    data_source: str | None = None  # overrides the preprocessor's default data_source
    role: str = "train"  # "train" or "eval"
    # JSONL files instead of a Hub repository (repo_id ""): store or hf://datasets/ URIs, read by the jsonl preprocessor
    train_file: str | None = None
    validation_file: str | None = None
    modality: str = (
        "text"  # "image": rows carry images (and <image> placeholders) that only a vision-language model reads
    )


BUILTIN: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", "openai/gsm8k", "gsm8k", config="main", allow_patterns=("main/*", "README.md")),
    "dapo_math": DatasetSpec(
        "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", "dapo_math", allow_patterns=("data/*", "README.md")
    ),
    "geometry3k": DatasetSpec(
        "geometry3k", "hiyouga/geometry3k", "geometry3k", allow_patterns=("data/*", "README.md"), modality="image"
    ),
    "aime2024": DatasetSpec(
        "aime2024", "Maxwell-Jia/AIME_2024", "aime", allow_patterns=("*.parquet", "*.jsonl", "README.md"), role="eval"
    ),
    # synthetic one-digit additions in GSM8K's form, generated into the offline Hub (pipeline_steps/local/synthetic.py)
    "arithmetic": DatasetSpec(
        "arithmetic", "pipeline-local/arithmetic", "gsm8k", allow_patterns=("data/*", "README.md")
    ),
    # synthetic three-digit multiplications (GSM8K's form) that the tiny model can only solve with the code tool
    "multiply": DatasetSpec("multiply", "pipeline-local/multiply", "gsm8k", allow_patterns=("data/*", "README.md")),
    # local JSONL files (no Hub repository): preprocess only, with --input pointing at a file or folder; the base of
    # every dataset named by JSONL file URIs (file_spec)
    "jsonl": DatasetSpec("jsonl", "", "jsonl"),
}
FILE_PREPROCESSORS = ("jsonl",)  # preprocessors that read the JSONL files a train_file/validation_file names
FILE_SCHEMES = ("file", "oss", "gs", "hf")

FIELD_TYPES = {  # registry field -> (check, what it must be)
    "repo_id": (lambda v: isinstance(v, str), "a string (org/name)"),
    "preprocessor": (lambda v: isinstance(v, str), "a string"),
    "config": (lambda v: isinstance(v, str), "a string"),
    "allow_patterns": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "data_source": (lambda v: isinstance(v, str), "a string"),
    "role": (lambda v: v in ("train", "eval"), "train or eval"),
    "train_file": (lambda v: isinstance(v, str), "a JSONL file URI"),
    "validation_file": (lambda v: isinstance(v, str), "a JSONL file URI"),
}


def _load_user_registry(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"dataset registry {p}: file not found; pass an existing YAML or JSON file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"dataset registry {p}: not UTF-8 text; save it as UTF-8 YAML or JSON") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:
        raise UserError(f"dataset registry {p}: cannot parse ({exc.__class__.__name__}); fix its syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"dataset registry {p}: top level must be a mapping of dataset name to entry")
    return data


def load(registry_file: str | None = None) -> dict[str, DatasetSpec]:
    specs = dict(BUILTIN)
    path = registry_file or settings.get(settings.DATASETS)
    if path:
        fields = {f.name for f in dataclasses.fields(DatasetSpec)}
        for name, entry in _load_user_registry(path).items():
            if not isinstance(entry, dict) or not NAME_RE.match(str(name)):
                raise UserError(f"dataset registry {path}: entry {name!r} must be a mapping under a lower-case name")
            unknown = set(entry) - fields
            if unknown:
                raise UserError(
                    f"dataset registry {path}: entry {name!r} has unknown keys {sorted(unknown)}; allowed: "
                    f"{sorted(fields - {'name'})}"
                )
            if ("repo_id" not in entry and "train_file" not in entry) or "preprocessor" not in entry:
                raise UserError(
                    f"dataset registry {path}: entry {name!r} needs repo_id (or train_file) and preprocessor"
                )
            if entry["preprocessor"] not in (known := preprocessor_names()):
                raise UserError(
                    f"dataset registry {path}: entry {name!r} preprocessor {entry['preprocessor']!r} unknown; choose "
                    f"one of {known}"
                )
            for key, want in FIELD_TYPES.items():  # a string where a list belongs would be split into characters
                if key in entry and entry[key] is not None and not want[0](entry[key]):
                    raise UserError(
                        f"dataset registry {path}: entry {name!r} {key}={entry[key]!r} must be {want[1]}; fix its type"
                    )
            if entry.get("train_file"):
                if entry["preprocessor"] not in FILE_PREPROCESSORS:
                    raise UserError(
                        f"dataset registry {path}: entry {name!r} names JSONL files; set preprocessor to one of "
                        f"{FILE_PREPROCESSORS}"
                    )
                check_file_uri(entry["train_file"], f"dataset registry {path}: entry {name!r} train_file")
            if entry.get("validation_file"):
                if not entry.get("train_file"):
                    raise UserError(f"dataset registry {path}: entry {name!r} has validation_file but no train_file")
                check_file_uri(entry["validation_file"], f"dataset registry {path}: entry {name!r} validation_file")
            entry = dict(
                entry, repo_id=entry.get("repo_id") or "", allow_patterns=tuple(entry.get("allow_patterns") or ())
            )
            specs[name] = DatasetSpec(name=name, **entry)
    return specs


def get(name: str, registry_file: str | None = None) -> DatasetSpec:
    specs = load(registry_file)
    if name not in specs:
        raise UserError(
            f"--dataset {name!r} is not a known dataset; choose one of {sorted(specs)} or add it to a registry file"
        )
    return specs[name]


# -- datasets named by JSONL file URIs ------------------------------------------------------------------------------


def check_file_uri(uri, what: str) -> str:
    """A JSONL file URI as the download step reads it, or a one-line UserError naming ``what``: a store object
    (``file:///abs/x.jsonl``, ``oss://bucket/key.jsonl``, ``gs://bucket/key.jsonl``) or a Hub dataset file
    (``hf://datasets/<org>/<name>[@<revision>]/<path>.jsonl``). Form values are untrusted: checked here, again in the
    step."""
    if not isinstance(uri, str) or not uri.strip():
        raise UserError(
            f"{what}: {'empty' if not uri else 'not a string'}; name a JSONL file URI such as "
            "oss://bucket/data/train.jsonl"
        )
    uri = uri.strip()
    shown = uri.encode("unicode_escape").decode()[:200]
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in FILE_SCHEMES:
        raise UserError(
            f"{what} {shown!r}: {'scheme ' + repr(scheme) if scheme else 'no scheme'} is not supported; use "
            "file:///abs/path.jsonl, oss://bucket/key.jsonl, gs://bucket/key.jsonl or "
            "hf://datasets/<org>/<name>/<path>.jsonl"
        )
    if not uri.endswith(".jsonl"):
        raise UserError(f"{what} {shown!r}: not a .jsonl file; name a JSONL file (one JSON object per line)")
    if scheme == "hf":
        hub_file(uri, what)
    else:
        from pipeline_steps.store import parse_uri

        try:
            parse_uri(uri)
        except UserError as exc:
            raise UserError(f"{what}: {exc}") from None
    return uri


def hub_file(uri: str, what: str):
    """``hf://datasets/...`` parsed by huggingface_hub's own parser (``HfUri``: id, revision, path_in_repo)."""
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    shown = uri.encode("unicode_escape").decode()[:200]
    if not uri.startswith("hf://datasets/"):
        raise UserError(f"{what} {shown!r}: a Hub file must be a dataset file, hf://datasets/<org>/<name>/<path>.jsonl")
    try:
        parsed = parse_hf_uri(uri)
    except HfUriError as exc:
        reason = " ".join(str(exc).split())
        raise UserError(f"{what} {shown!r}: not a Hub dataset file URI ({reason[:160]})") from None
    if parsed.type != "dataset" or not parsed.path_in_repo.endswith(".jsonl"):
        raise UserError(
            f"{what} {shown!r}: name a .jsonl file inside the repository, hf://datasets/<org>/<name>/x.jsonl"
        )
    return parsed


def file_dataset_name(train_file: str, taken=()) -> str:
    """The dataset name of a JSONL file chosen by URI: the Hub repository's name for a Hub file, else the file's name
    without ``.jsonl``; lower-case, other characters as ``-``. A name already in ``taken`` (a registry entry) gets
    ``-jsonl`` appended, so a file called gsm8k.jsonl never becomes a version of the gsm8k dataset."""
    if train_file.startswith("hf://"):
        stem = hub_file(train_file, "train file").id.split("/", 1)[1]
    else:
        stem = train_file.rstrip("/").rsplit("/", 1)[-1].removesuffix(".jsonl")
    name = re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).strip("-._")[:58] or "data"
    return f"{name}-jsonl" if name in taken else name


def file_spec(
    train_file: str,
    validation_file: str | None = None,
    name: str | None = None,
    registry_file: str | None = None,
    what: tuple[str, str] = ("--train-file", "--validation-file"),
) -> DatasetSpec:
    """A dataset made of JSONL files named by URI. ``name`` may be a registry entry with ``train_file`` (its other
    fields, e.g. data_source, are kept and the files replaced: pinned Hub revisions), or a new name; without it the
    name is :func:`file_dataset_name`'s."""
    check_file_uri(train_file, what[0])
    if validation_file:
        check_file_uri(validation_file, what[1])
    specs = load(registry_file)
    if name and not NAME_RE.match(name):
        raise UserError(f"--dataset {name!r}: use a lower-case name of letters, digits, '_', '.', '-' (64 at most)")
    base = specs.get(name) if name else None
    if base is not None and not base.train_file and base.name != "jsonl":
        raise UserError(
            f"--dataset {name!r} is the registry's Hub dataset {base.repo_id}; a JSONL file needs another name"
        )
    if base is None:
        base = dataclasses.replace(BUILTIN["jsonl"], name=name or file_dataset_name(train_file, specs))
    return dataclasses.replace(base, repo_id="", train_file=train_file.strip(), validation_file=validation_file or None)


def for_step(args) -> DatasetSpec:
    """The dataset a step works on, from its ``--dataset``, ``--registry`` and (optional) ``--train-file`` and
    ``--validation-file`` arguments."""
    train, validation = getattr(args, "train_file", None), getattr(args, "validation_file", None)
    if train:
        return file_spec(train, validation, args.dataset, args.registry)
    if validation:
        raise UserError("--validation-file needs --train-file (the training JSONL file)")
    if not args.dataset:
        raise UserError("pass --dataset (a registry name) or --train-file (a JSONL file URI)")
    return get(args.dataset, args.registry)
