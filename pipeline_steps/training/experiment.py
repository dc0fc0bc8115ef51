"""Experiment presets and the verl config they compose to.

A preset (``pipeline_steps/training/presets/<name>.yaml``, or ``$PIPELINE_PRESETS_DIR/<name>.yaml``) holds
what the pipeline needs around verl (model, datasets, cluster shape, evaluation settings) and a ``verl:`` map of
verl Hydra overrides. A run merges, last one winning: the preset's ``verl`` map,
the keys the pipeline derives (data files, model path, nodes, checkpoint dir),
and free-form ``KEY=VALUE`` overrides typed by the user.

:func:`compose` hands the result to verl's own Hydra config
(``verl.trainer.config/ppo_trainer``), so unknown keys and bad types fail the
way they would on the cluster, but on CPU in seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import re
from pathlib import Path

import yaml

from pipeline_steps import library_env, settings
from pipeline_steps.errors import UserError
from pipeline_steps.training import overrides as override_rules

PRESETS_ENV = settings.PRESETS_DIR  # a deployment's own presets; they shadow the packaged ones by name


def preset_dirs() -> list[Path]:
    """Where presets are looked up, first match wins: ``$PIPELINE_PRESETS_DIR``, then the packaged ones."""
    packaged = Path(str(importlib.resources.files("pipeline_steps.training") / "presets"))
    extra = settings.get(PRESETS_ENV)
    return [Path(extra), packaged] if extra else [packaged]


def preset_names(offered: bool = False) -> list[str]:
    """Every preset's name; ``offered``: only those the trigger form offers, i.e. not marked ``form: false`` (a preset
    meant for another entry point, such as ``make demo-tools``, which the DAG's checks would refuse)."""
    names = sorted({p.stem for d in preset_dirs() for p in d.glob("*.yaml")})
    return [n for n in names if offered_in_form(n)] if offered else names


def offered_in_form(name: str) -> bool:
    """Does the trigger form offer preset ``name``? Yes unless its YAML says ``form: false``; a preset that cannot be
    read stays offered (the plan reports what is wrong with it). Reads the YAML only: cheap enough for DAG parsing."""
    try:
        spec = yaml.safe_load(resolve_path(name).read_text(encoding="utf-8")) or {}
    except Exception:
        return True
    return not (isinstance(spec, dict) and spec.get("form") is False)


def check_offered(exp: Experiment) -> None:
    """Refuse, in one line, a run of a preset the form does not offer (``form: false``): a REST API conf or a scheduled
    run naming it would fail later, after downloads, in pre-flight."""
    if exp.spec.get("form") is False:
        why = exp.spec.get("form_note") or "it is meant for another entry point, not for a DAG run"
        raise UserError(
            f"experiment {exp.name!r} is not offered for DAG runs (form: false: {why}); choose one of "
            f"{preset_names(offered=True)}"
        )


# What a model reads, when its config.json is not on this machine. Hub id prefix -> transformers model_type (longest
# prefix wins); a model_type reads images when its transformers config class has a ``vision_config`` sub-config
# (tests/unit/pipeline_steps/training/test_modalities.py checks this table against transformers' classes).
KNOWN_ARCHITECTURES = {
    "Qwen/Qwen3.5-": "qwen3_5",  # natively multimodal: Qwen3_5ForConditionalGeneration, a vision_config
    "Qwen/Qwen3-VL-": "qwen3_vl",
    "Qwen/Qwen2.5-VL-": "qwen2_5_vl",
    "Qwen/Qwen2-VL-": "qwen2_vl",
    "Qwen/Qwen3-": "qwen3",
    "Qwen/Qwen2.5-": "qwen2",
}
IMAGE_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_vl", "qwen2_5_vl", "qwen2_vl"})
# the models built on this machine (stage-model --model NAME; pipeline_steps/local/)
LOCAL_BUILDS = {"tiny": ("text",), "tiny-tool": ("text",), "tiny-vl": ("text", "image")}


def _cached_config(repo_id: str, revision: str | None) -> dict | None:
    """The model's config.json from the Hugging Face cache on this machine, without the network; None if absent."""
    try:
        from huggingface_hub import try_to_load_from_cache

        # the cache the process is pointed at now (huggingface_hub reads HF_HUB_CACHE once, at its import)
        cache = os.environ.get(library_env.HF_HUB_CACHE) or None
        path = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision or "main")
        if isinstance(path, str):
            return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:
        return None
    return None


def model_modalities(spec: dict, model: str | None = None, revision: str | None = None) -> tuple[set[str], str]:
    """What the run's model reads, and how that is known: ``model`` (the form's) or the preset's ``model.source``.

    In order: a model built locally (its builder's table); the model's ``config.json`` in the Hugging Face cache (a
    ``vision_config`` means images); the preset's declared ``model.modalities`` (only for the preset's own model);
    :data:`KNOWN_ARCHITECTURES`; else text only, said to be assumed."""
    declared_for = (spec.get("model") or {}).get("source") or (spec.get("model") or {}).get("repo_id")
    model = (model or declared_for or "").strip()
    if model in LOCAL_BUILDS:
        return set(LOCAL_BUILDS[model]), f"built locally as {model}"
    config = _cached_config(model, revision) if "/" in model else None
    if config is not None:
        reads = {"text", "image"} if config.get("vision_config") else {"text"}
        return reads, f"its config.json (model_type {config.get('model_type')!r})"
    declared = (spec.get("model") or {}).get("modalities")
    if declared and model == declared_for:
        return set(declared), "the preset's model.modalities"
    prefixes = sorted((p for p in KNOWN_ARCHITECTURES if model.startswith(p)), key=len, reverse=True)
    if prefixes:
        model_type = KNOWN_ARCHITECTURES[prefixes[0]]
        reads = {"text", "image"} if model_type in IMAGE_MODEL_TYPES else {"text"}
        return reads, f"known architecture {model_type}"
    return {"text"}, "no config.json on this machine and no declared model.modalities: assumed"


def modalities(spec: dict, model: str | None = None) -> set[str]:
    """What a preset's model (or ``model``, the form's) reads (:func:`model_modalities`)."""
    return model_modalities(spec, model)[0]


def presets_reading(modality: str) -> list[str]:
    """Presets whose model reads ``modality`` (:func:`model_modalities`), for the fix a refusal names.

    Reads the YAML only; a preset that cannot be read is left out (plan reports it when it is chosen).
    """
    out = []
    for name in preset_names():
        try:
            spec = yaml.safe_load(resolve_path(name).read_text(encoding="utf-8")) or {}
            if modality in modalities(spec):
                out.append(name)
        except Exception:
            continue
    return out


MM_PROCESSOR_KWARGS = "data.mm_processor_kwargs"  # verl 0.9.1: the multimodal processor's settings (pixel limits)


def mm_processor_kwargs(verl: dict) -> dict:
    """The run's ``data.mm_processor_kwargs`` from a verl override map, whether set whole or per key (``+`` leaves:
    verl's default is an empty map, which Hydra cannot merge new keys into). Evaluation scales figures as training."""
    out: dict = {}
    for key, value in verl.items():
        bare = str(key).lstrip("+")
        if bare == MM_PROCESSOR_KWARGS and isinstance(value, dict):
            out.update(value)
        elif bare.startswith(MM_PROCESSOR_KWARGS + "."):
            out[bare[len(MM_PROCESSOR_KWARGS) + 1 :]] = value
    return out


KEY_RE = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


@dataclasses.dataclass
class Experiment:
    name: str
    spec: dict  # the preset, with pipeline-level sections (model, datasets, cluster, evaluation, ...)
    verl: dict  # verl Hydra overrides, dotted key -> value, in application order

    def overrides(self) -> list[str]:
        """Hydra override strings, every value rendered as a Hydra literal."""
        return [f"{k}={hydra_value(v)}" for k, v in self.verl.items()]

    def digest(self) -> str:
        """Hash of everything that decides the training run (for lineage)."""
        blob = json.dumps({"spec": self.spec, "verl": self.verl}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()


def hydra_value(v) -> str:
    """Render a Python value as a Hydra override literal (strings always quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_dict_key(k)}:{hydra_value(x)}" for k, x in v.items()) + "}"
    return quote_string(str(v))


def quote_string(s: str) -> str:
    """A string as a Hydra quoted literal that composes back to exactly ``s``.

    Hydra's own ``QuotedString`` escapes quotes and the backslashes before them;
    on top of that OmegaConf would resolve ``${...}`` inside the string (for
    example ``${oc.env:AWS_SECRET_ACCESS_KEY}``), so ``${`` is escaped as ``\\${``
    (doubling any backslashes right before it, which OmegaConf would unescape).
    """
    from hydra.core.override_parser.types import Quote, QuotedString

    s = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", s)
    return QuotedString(text=s, quote=Quote.double).with_quotes()  # double: reads cleanly once shell-quoted


def _dict_key(k) -> str:
    k = str(k)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", k):
        raise UserError(f"mapping key {k!r} in an override value: use letters, digits, '_', '-' or '.' only")
    return k


def cluster_keys(spec: dict) -> dict:
    """verl keys that follow from the preset's ``cluster`` section (one place for the shape).

    A CPU-only preset (``gpus_per_node: 0``, the local backend) leaves
    ``trainer.n_gpus_per_node`` to its ``verl`` map: the CPU trainer is one process.
    """
    cluster = spec.get("cluster") or {}
    if not isinstance(cluster, dict):
        raise UserError("experiment: 'cluster' must be a mapping (nnodes, gpus_per_node, image, ...)")
    out = {}
    if "nnodes" in cluster:
        out["trainer.nnodes"] = cluster["nnodes"]
    if cluster.get("gpus_per_node"):
        out["trainer.n_gpus_per_node"] = cluster["gpus_per_node"]
    return out


def parse_override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` typed by a user -> (key, value parsed as YAML scalar/list)."""
    if text.strip().startswith("~"):  # Hydra's delete syntax (with or without a value)
        override_rules.check(text.strip().split("=", 1)[0], None, f"override {text[:80]!r}")
    if "=" not in text:
        raise UserError(f"--override {text!r}: expected KEY=VALUE, for example actor_rollout_ref.actor.optim.lr=1e-6")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not KEY_RE.match(key):
        raise UserError(f"--override {text!r}: {key!r} is not a dotted config key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string; users mean a number
        try:
            value = float(value) if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()) else value
        except ValueError:
            pass
    if not isinstance(value, (dict, list, bool, int, float)) and value is not None:
        value = str(raw)
    override_rules.check(key, value, f"override {text[:80]!r}")
    return key, value


def resolve_path(name_or_file: str) -> Path:
    p = Path(name_or_file)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    if re.fullmatch(r"[A-Za-z0-9_.-]+", name_or_file):
        for d in preset_dirs():
            if (cand := d / f"{name_or_file}.yaml").is_file():
                return cand
    known = preset_names()
    raise UserError(f"--experiment {name_or_file!r}: no such preset file or name; known presets: {known}")


def load(name_or_file: str, overrides: list[str] | None = None, derived: dict | None = None) -> Experiment:
    """Load a preset and merge pipeline-derived keys and user overrides (user wins)."""
    return merged(read(name_or_file), overrides, derived)


def read(name_or_file: str) -> Experiment:
    """A preset as written (its verl keys checked, its cluster shape's keys merged): the one read of its file."""
    path = resolve_path(name_or_file)
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"experiment {path}: invalid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("verl", {}), dict):
        raise UserError(f"experiment {path}: must be a mapping with a 'verl' mapping of overrides")
    verl = dict(spec.pop("verl", {}) or {})
    for key, value in verl.items():
        if not KEY_RE.match(str(key)):
            raise UserError(f"experiment {path}: verl key {key!r} is not a dotted config key")
        override_rules.check(str(key), value, f"experiment {path}", user=False)
    for k, v in cluster_keys(spec).items():
        verl.pop(k, None)  # later sources win and are applied later
        verl[k] = v
    spec.setdefault("name", path.stem)
    return Experiment(name=str(spec["name"]), spec=copy.deepcopy(spec), verl=verl)


def merged(base: Experiment, overrides: list[str] | None = None, derived: dict | None = None) -> Experiment:
    """``base`` (a preset as :func:`read` gives it, or as a run plan holds it) with pipeline-derived keys and then
    user overrides merged (user wins); reads no file."""
    verl = dict(base.verl)
    for k, v in (derived or {}).items():
        verl.pop(k, None)  # later sources win and are applied later
        verl[k] = v
    for text in overrides or []:
        k, v = parse_override(text)
        verl.pop(k, None)  # re-insert so the user's value is applied last
        verl[k] = v
    return Experiment(name=base.name, spec=copy.deepcopy(base.spec), verl=verl)


def from_plan(run: dict, derived: dict | None = None) -> Experiment:
    """The run's experiment from its plan (:func:`pipeline_steps.planning.plan.plan`): the preset the plan read, the
    run's derived keys, then the run's overrides. Reads no preset file: the preset as planned is what runs, whatever
    its file says now.

    :raises UserError: the plan's preset does not match its ``preset_sha256`` (the plan was edited after ``plan``).
    """
    preset = run["preset"]
    base = Experiment(name=preset["name"], spec=preset["spec"], verl=preset["verl"])
    if run.get("preset_sha256") and base.digest() != run["preset_sha256"]:
        raise UserError(
            f"plan: preset {base.name!r} does not match the plan's preset_sha256 {run['preset_sha256'][:12]}: the "
            "plan was changed after the plan task made it; re-run the DAG (a new plan) instead of editing plan.json"
        )
    return merged(base, run.get("overrides") or [], derived)


@functools.lru_cache(maxsize=1)
def verl_defaults() -> dict:
    """verl's flattened default trainer config (``_generated_ppo_trainer.yaml``, kept in sync by verl's CI).

    Read as plain YAML: locating the package does not import verl (which takes seconds).
    """
    spec = importlib.util.find_spec("verl")
    path = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=loader) or {}


def suggest_key(key: str) -> str | None:
    """The closest existing verl key to a misspelt one (same parent section first)."""
    import difflib

    node, parts = verl_defaults(), key.lstrip("+").split(".")
    prefix = []
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            break
        node, prefix = node[part], prefix + [part]
    if not isinstance(node, dict):
        return None
    rest = ".".join(parts[len(prefix) :])
    match = difflib.get_close_matches(rest, [str(k) for k in node], n=1, cutoff=0.6)
    return ".".join(prefix + [match[0]]) if match else None


def compose(exp: Experiment):
    """verl's own Hydra composition of ``ppo_trainer`` with the experiment's overrides.

    Raises UserError naming the offending key when Hydra rejects an override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, OverrideParseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return hydra_compose(config_name="ppo_trainer", overrides=exp.overrides())
    except (ConfigCompositionException, OverrideParseException) as exc:
        cause = exc.__cause__ or exc
        msg = " ".join(str(cause).split())
        m = re.search(r"Could not override '([^']+)'", str(exc))
        key = m.group(1) if m else None
        if key and "not in struct" in msg:
            hint = suggest_key(key)
            hint = f" (did you mean {hint}?)" if hint else ""
            raise UserError(
                f"verl override {key!r}: no such key in verl's ppo_trainer config{hint}; fix its spelling or prefix it "
                "with '+' to add a new key"
            ) from None
        if key:
            raise UserError(
                f"verl override {key!r} rejected: {msg[:300]}; check the key's spelling against verl's ppo_trainer "
                "config"
            ) from None
        raise UserError(f"verl config does not compose: {msg[:300]}") from None
    finally:
        GlobalHydra.instance().clear()
