"""Known datasets: which Hub repository, which files, which preprocessor.

Users add their own without code: a YAML or JSON file named by ``--registry`` or
``$PIPELINE_DATASETS`` holding ``{name: {repo_id, preprocessor, ...}}`` entries
(the same fields as :class:`DatasetSpec`); they are merged over the built-ins.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from pipeline_steps.errors import UserError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo_id: str
    preprocessor: str  # module name under pipeline_steps.data.preprocessors
    config: str | None = None  # the repository's subset folder (gsm8k: "main")
    allow_patterns: tuple[str, ...] = ()  # files to download; empty means all
    data_source: str | None = None  # overrides the preprocessor's default data_source
    role: str = "train"  # "train" or "eval"


BUILTIN: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", "openai/gsm8k", "gsm8k", config="main", allow_patterns=("main/*", "README.md")),
    "dapo_math": DatasetSpec(
        "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", "dapo_math", allow_patterns=("data/*", "README.md")
    ),
    "geometry3k": DatasetSpec("geometry3k", "hiyouga/geometry3k", "geometry3k", allow_patterns=("data/*", "README.md")),
    "aime2024": DatasetSpec(
        "aime2024", "Maxwell-Jia/AIME_2024", "aime", allow_patterns=("*.parquet", "*.jsonl", "README.md"), role="eval"
    ),
    # synthetic one-digit additions in GSM8K's form, generated into the offline Hub (pipeline_steps/local/synthetic.py)
    "arithmetic": DatasetSpec(
        "arithmetic", "pipeline-local/arithmetic", "gsm8k", allow_patterns=("data/*", "README.md")
    ),
    # local JSONL files (no Hub repository): preprocess only, with --input pointing at a file or folder
    "jsonl": DatasetSpec("jsonl", "", "jsonl"),
}

PREPROCESSORS = ("gsm8k", "dapo_math", "geometry3k", "aime", "jsonl")
FIELD_TYPES = {  # registry field -> (check, what it must be)
    "repo_id": (lambda v: isinstance(v, str), "a string (org/name)"),
    "preprocessor": (lambda v: isinstance(v, str), "a string"),
    "config": (lambda v: isinstance(v, str), "a string"),
    "allow_patterns": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "data_source": (lambda v: isinstance(v, str), "a string"),
    "role": (lambda v: v in ("train", "eval"), "train or eval"),
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
    path = registry_file or os.environ.get("PIPELINE_DATASETS")
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
            if "repo_id" not in entry or "preprocessor" not in entry:
                raise UserError(f"dataset registry {path}: entry {name!r} needs repo_id and preprocessor")
            if entry["preprocessor"] not in PREPROCESSORS:
                raise UserError(
                    f"dataset registry {path}: entry {name!r} preprocessor {entry['preprocessor']!r} unknown; choose "
                    f"one of {PREPROCESSORS}"
                )
            for key, want in FIELD_TYPES.items():  # a string where a list belongs would be split into characters
                if key in entry and entry[key] is not None and not want[0](entry[key]):
                    raise UserError(
                        f"dataset registry {path}: entry {name!r} {key}={entry[key]!r} must be {want[1]}; fix its type"
                    )
            entry = dict(entry, allow_patterns=tuple(entry.get("allow_patterns") or ()))
            specs[name] = DatasetSpec(name=name, **entry)
    return specs


def get(name: str, registry_file: str | None = None) -> DatasetSpec:
    specs = load(registry_file)
    if name not in specs:
        raise UserError(
            f"--dataset {name!r} is not a known dataset; choose one of {sorted(specs)} or add it to a registry file"
        )
    return specs[name]
