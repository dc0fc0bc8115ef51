"""The trigger form's fields that set verl keys: one table, the only copy.

The DAG builds the form's ``Param`` of each field from it (JSON schema, title, section, description), the plan turns
a submitted form into verl overrides with it (:func:`overrides`), and the form shows each field's preset value
(:func:`preset_summary`) read through it. Plain data: no Airflow, cheap to import.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Field:
    """One form field and the verl key it sets.

    :param verl_key: the verl key the field's value goes to.
    :param schema: the form's JSON schema keywords for the field (every field may stay empty: null allowed).
    :param title: the form's label.
    :param section: the form's section.
    :param lead: text before "empty = the preset's (...)" in the field's description.
    :param switch: a boolean verl key the value turns on (above 0) or off (0), set before ``verl_key``.
    :param cluster: the preset's ``cluster`` key holding the preset's value (else the ``verl`` map's ``verl_key``).
    """

    verl_key: str
    schema: dict
    title: str
    section: str = "Hyperparameters"
    lead: str = ""
    switch: str | None = None
    cluster: str | None = None

    def preset_value(self, spec: dict, verl: dict):
        """The preset's value of this field (``spec`` without its ``verl`` map, which is ``verl``)."""
        if self.cluster:
            return (spec.get("cluster") or {}).get(self.cluster)
        if self.switch and not verl.get(self.switch):
            return 0
        return verl.get(self.verl_key)


FIELDS: dict[str, Field] = {
    "learning_rate": Field(
        "actor_rollout_ref.actor.optim.lr",
        {"type": ["null", "number"], "exclusiveMinimum": 0, "maximum": 1},
        "Learning rate",
        lead="The main GRPO knobs. ",
    ),
    "rollout_n": Field(
        "actor_rollout_ref.rollout.n",
        {"type": ["null", "integer"], "minimum": 1, "maximum": 1024},
        "Rollouts per prompt (GRPO group size)",
    ),
    "train_batch_size": Field(
        "data.train_batch_size", {"type": ["null", "integer"], "minimum": 1}, "Train batch size (prompts)"
    ),
    "total_training_steps": Field(
        "trainer.total_training_steps", {"type": ["null", "integer"], "minimum": 1}, "Total training steps"
    ),
    "kl_coef": Field(
        "actor_rollout_ref.actor.kl_loss_coef",
        {"type": ["null", "number"], "minimum": 0},
        "KL loss coefficient (0 = off)",
        switch="actor_rollout_ref.actor.use_kl_loss",
    ),
    "nnodes": Field(
        "trainer.nnodes",
        {"type": ["null", "integer"], "minimum": 1, "maximum": 64},
        "Nodes",
        section="Cluster",
        lead="Where training runs. ",
        cluster="nnodes",
    ),
    "gpus_per_node": Field(
        "trainer.n_gpus_per_node",
        {"type": ["null", "integer"], "minimum": 0, "maximum": 16},
        "GPUs per node",
        section="Cluster",
        cluster="gpus_per_node",
    ),
}


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
