"""The trigger form's fields that set verl keys: one table, the only copy.

The DAG builds the form's ``Param`` of each field from it (JSON schema, title, section, description), the plan turns
a submitted form into verl overrides with it (:func:`overrides`), and the form shows each field's preset value
(:func:`preset_summary`) read through it. Each field's JSON schema (type and range) is its verl key's row in the
reviewed table of :mod:`pipeline_steps.training.form_keys`, the same row the plan checks a free-form override of that
key against. :func:`check_params` bounds everything else a form or a REST API conf hands the plan (sizes of strings,
lists and mappings; numeric fields' ranges) before anything is read or written. Plain data: no Airflow, cheap to
import.
"""

from __future__ import annotations

import dataclasses
import math

from pipeline_steps.errors import UserError
from pipeline_steps.training import form_keys

# Size limits of what the form (or the REST API's conf) may hand the plan: the plan is written whole into XCom and
# plan.json, so a 10 MB string is refused at plan, in one line, instead of being carried through the run.
MAX_TEXT = 1024  # characters of any one string (URIs, names, revisions)
MAX_OVERRIDE = 512  # characters of one verl override KEY=VALUE
MAX_OVERRIDES = 64  # verl overrides
MAX_ITEMS = 32  # items of any other list or mapping (datasets, pinned revisions)
MAX_DEPTH = 3  # nesting of lists and mappings (dataset_revisions is a mapping of strings)
# one verl override as the form's JSON schema checks it: a key of the reviewed table, a bounded length
OVERRIDE_ITEM = {"type": "string", "maxLength": MAX_OVERRIDE, "pattern": form_keys.override_pattern()}


@dataclasses.dataclass(frozen=True)
class Field:
    """One form field and the verl key it sets.

    :param verl_key: the verl key the field's value goes to (a key of the reviewed table
        :data:`pipeline_steps.training.form_keys.KEYS`, whose type and range make the field's JSON schema: every
        field may stay empty, null allowed).
    :param title: the form's label.
    :param section: the form's section.
    :param lead: text before "empty = the preset's (...)" in the field's description.
    :param switch: a boolean verl key the value turns on (above 0) or off (0), set before ``verl_key``.
    :param cluster: the preset's ``cluster`` key holding the preset's value (else the ``verl`` map's ``verl_key``).
    """

    verl_key: str
    title: str
    section: str = "Hyperparameters"
    lead: str = ""
    switch: str | None = None
    cluster: str | None = None

    @property
    def schema(self) -> dict:
        """The form's JSON schema keywords: the verl key's type and range from the reviewed table."""
        return form_keys.KEYS[self.verl_key].json_schema()

    def preset_value(self, spec: dict, verl: dict):
        """The preset's value of this field (``spec`` without its ``verl`` map, which is ``verl``)."""
        if self.cluster:
            return (spec.get("cluster") or {}).get(self.cluster)
        if self.switch and not verl.get(self.switch):
            return 0
        return verl.get(self.verl_key)


FIELDS: dict[str, Field] = {
    "learning_rate": Field("actor_rollout_ref.actor.optim.lr", "Learning rate", lead="The main GRPO knobs. "),
    "rollout_n": Field("actor_rollout_ref.rollout.n", "Rollouts per prompt (GRPO group size)"),
    "train_batch_size": Field("data.train_batch_size", "Train batch size (prompts)"),
    "total_training_steps": Field("trainer.total_training_steps", "Total training steps"),
    "kl_coef": Field(
        "actor_rollout_ref.actor.kl_loss_coef",
        "KL loss coefficient (0 = off)",
        switch="actor_rollout_ref.actor.use_kl_loss",
    ),
    "nnodes": Field("trainer.nnodes", "Nodes", section="Cluster", lead="Where training runs. ", cluster="nnodes"),
    "gpus_per_node": Field("trainer.n_gpus_per_node", "GPUs per node", section="Cluster", cluster="gpus_per_node"),
}


def _size_error(where: str, what: str, limit: str) -> UserError:
    return UserError(
        f"form field {where}: {what}, over the limit of {limit}; shorten it (settings that need more belong in a "
        "preset under $PIPELINE_PRESETS_DIR)"
    )


def _check_size(value, where: str, depth: int = 0, text_limit: int = MAX_TEXT, item_limit: int = MAX_ITEMS) -> None:
    if isinstance(value, str):
        if len(value) > text_limit:
            raise _size_error(where, f"{len(value)} characters ({value[:40]!r}...)", f"{text_limit} characters")
    elif isinstance(value, (list, tuple, dict)):
        if depth >= MAX_DEPTH:
            raise _size_error(where, f"nested {depth + 1} levels deep", f"{MAX_DEPTH} levels")
        if len(value) > item_limit:
            raise _size_error(where, f"{len(value)} items", f"{item_limit} items")
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in pairs:
            _check_size(str(k), f"{where} key", depth + 1)
            _check_size(
                v, f"{where}[{k!r}]" if isinstance(value, dict) else f"{where} item {k + 1}", depth + 1, text_limit
            )
    elif isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"form field {where}: {value} is not a finite number")


def check_params(params: dict) -> None:
    """Refuse in one line, before anything is read or written: a string, list or mapping over its size limit (every
    field, and any other key of a REST API conf), ``verl_overrides`` that is not a list of strings, and a numeric
    field out of its range (the reviewed table's, which the form's JSON schema carries too)."""
    if not isinstance(params, dict):
        raise UserError(f"run conf: expected a mapping of the form's fields, got {type(params).__name__}")
    if len(params) > 4 * MAX_ITEMS:
        raise UserError(
            f"run conf: {len(params)} fields, over the limit of {4 * MAX_ITEMS}; send the form's fields only"
        )
    for name, value in params.items():
        _check_size(str(name), "name", 1)
        if name == "verl_overrides" and value is not None:
            if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
                raise UserError("form field verl_overrides: expected a list of KEY=VALUE strings")
            _check_size(value, repr(name), text_limit=MAX_OVERRIDE, item_limit=MAX_OVERRIDES)
        else:
            _check_size(value, repr(name))
    for name, field in FIELDS.items():
        value = params.get(name)
        if value is None:
            continue
        rule = form_keys.KEYS[field.verl_key]
        if not rule.fits(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise UserError(f"form field {name!r}={shown}: expected {rule.describe()} ({field.verl_key})")


def overrides(params: dict) -> list[str]:
    """The form's fields as verl overrides (a switched field last), then the smoke run's, then the free-form ones
    (applied last, so they win)."""
    out, switched = [], []
    for name, field in FIELDS.items():
        if params.get(name) is None:
            continue
        if field.switch:
            on = "true" if float(params[name]) > 0 else "false"
            switched += [f"{field.switch}={on}", f"{field.verl_key}={params[name]}"]
        else:
            out.append(f"{field.verl_key}={params[name]}")
    out += switched
    if params.get("smoke"):
        out += ["trainer.total_training_steps=1", "trainer.save_freq=1"]
    return out + list(params.get("verl_overrides") or [])


def preset_summary(name: str) -> dict[str, str]:
    """A preset's main values as short text for the trigger form (empty when the preset cannot be read).

    Reads the YAML only: cheap enough for DAG parsing.
    """
    import yaml

    from pipeline_steps.training.experiment import resolve_path

    try:
        spec = yaml.safe_load(resolve_path(name).read_text(encoding="utf-8")) or {}
    except Exception:  # the form must render even if a deployment's preset is broken; plan reports it
        return {}
    verl = spec.get("verl") or {}
    model = spec.get("model") or {}
    values = {
        "datasets": ", ".join((spec.get("datasets") or {}).get("train") or []),
        "eval_dataset": (spec.get("evaluation") or {}).get("dataset"),
        "model": model.get("source") or model.get("repo_id"),
        "model_revision": model.get("revision"),
        **{name: field.preset_value(spec, verl) for name, field in FIELDS.items()},  # the form's verl fields
    }
    if values["total_training_steps"] is None:
        values["total_training_steps"] = "epochs: " + str(verl.get("trainer.total_epochs", "verl's default"))
    return {k: str(v) for k, v in values.items() if v not in (None, "")}
