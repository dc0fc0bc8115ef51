"""The run plan as typed objects: :class:`RunPlan` (with its :class:`DatasetPlan` items, its :class:`ModelPlan` and its
:class:`~pipeline_steps.planning.layout.RunLayout`) and the evaluation DAG's :class:`EvaluationPlan`.

The plan travels as a JSON dict (Airflow's XCom carries the dict, ``plan.json`` in the run directory holds it): a task,
an operator or a step rebuilds the object with ``from_dict`` and ``to_dict`` gives back exactly that dict. A dict
missing a key the plan task always writes is refused in one line naming the key (a plan from another version of the
pipeline, or edited by hand): re-run the DAG for a new plan.

Standard library only: the DAG files import it at parse time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline_steps.constants import BACKENDS
from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout


def _take(d: Any, cls, what: str) -> dict:
    """The constructor arguments of dataclass ``cls`` from ``d``: every required key present (one line otherwise),
    optional ones (``metadata={"optional": True}``) when present; keys the class does not know are ignored."""
    if not isinstance(d, dict):
        raise UserError(f"{what}: expected a JSON object, got {type(d).__name__}; pass the plan the plan task wrote")
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            out[f.name] = d[f.name]
        elif not f.metadata.get("optional"):
            raise UserError(
                f"{what}: no {f.name!r} in it (a plan from another version of the pipeline?); re-run the DAG for a "
                "new plan"
            )
    return out


def _check_backend(backend: Any, what: str) -> None:
    """A plan names the backend its tasks run on, resolved when it was made: anything but ``local`` or ``kuberay``
    (a plan edited by hand) is refused in one line, not run as a RayJob."""
    if backend not in BACKENDS:
        raise UserError(
            f"{what}: backend {backend!r}: choose 'local' or 'kuberay' (a plan edited by hand?); re-run the DAG for "
            "a new plan"
        )


def _dict(obj) -> dict:
    """A plan object as its JSON dict: optional fields left out when None (as the plan task writes them)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("optional") and value is None:
            continue
        out[f.name] = value
    return out


@dataclasses.dataclass(frozen=True)
class DatasetPlan:
    """One dataset of a run: which revision, which row variant, and its ``download``/``preprocess``/``upload`` argv
    (``steps``, with placeholders for what the earlier step reports)."""

    dataset: str
    role: str  # "train", "eval" or "prepare"
    revision: str
    resolved: dict
    variant: str
    limit: int | None
    work: str
    store: str
    steps: dict
    files: dict | None = dataclasses.field(default=None, metadata={"optional": True})  # JSONL files: split -> URI

    @classmethod
    def from_dict(cls, d: dict) -> DatasetPlan:
        name = d.get("dataset") if isinstance(d, dict) else None
        return cls(**_take(d, cls, f"plan dataset {name!r}" if name else "plan dataset"))

    def to_dict(self) -> dict:
        return _dict(self)

    @property
    def tag(self) -> str:
        """The processed output's variant tag: the row variant, and the row limit of a smoke run."""
        return self.variant + (f"-limit{self.limit}" if self.limit else "")


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The model a run trains: the ``stage-model`` step's argv and what its task carries."""

    args: list
    carry: dict

    @classmethod
    def from_dict(cls, d: dict) -> ModelPlan:
        return cls(**_take(d, cls, "plan model"))

    def to_dict(self) -> dict:
        return _dict(self)

    @property
    def name(self) -> str:
        return str(self.carry.get("model") or self._arg("--model"))

    @property
    def revision(self) -> str | None:
        return self._arg("--revision")

    def _arg(self, flag: str) -> str | None:
        args = list(self.args)
        return args[args.index(flag) + 1] if flag in args[:-1] else None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A ``verl_grpo_pipeline`` run's plan (:func:`pipeline_steps.planning.making.plan`)."""

    experiment: str
    preset: dict  # {"name", "spec", "verl"}: the preset as read, once
    preset_sha256: str
    backend: str
    overrides: list
    evaluation: dict
    eval_dataset: str | None
    val_datasets: list
    mounts: list
    datasets: list  # [DatasetPlan]
    model: ModelPlan
    store: str
    work: str
    run_key: str
    run_dir: str
    dag_id: str
    run_id: str
    smoke: bool
    steps: dict  # step name -> argv template

    @classmethod
    def from_dict(cls, d: dict) -> RunPlan:
        if isinstance(d, RunPlan):
            return d
        kw = _take(d, cls, "plan")
        _check_backend(kw["backend"], "plan")
        if not isinstance(kw["preset"], dict):
            raise UserError("plan: 'preset' is not a preset (name, spec, verl); pass the plan the plan task wrote")
        kw["datasets"] = [DatasetPlan.from_dict(item) for item in kw["datasets"]]
        kw["model"] = ModelPlan.from_dict(kw["model"])
        return cls(**kw)

    def to_dict(self) -> dict:
        out = _dict(self)
        out["datasets"] = [d.to_dict() for d in self.datasets]
        out["model"] = self.model.to_dict()
        return out

    @property
    def layout(self) -> RunLayout:
        return RunLayout(store=self.store, run_dir=self.run_dir, work=self.work)

    def template(self, step: str) -> list[str]:
        """The argv the plan recorded for ``step`` (one line naming the step when it has none: another backend's)."""
        if step not in self.steps:
            raise UserError(
                f"plan: no {step!r} step in it (planned for the {self.backend} backend: {sorted(self.steps)}); "
                "re-run the DAG for a new plan"
            )
        return list(self.steps[step])

    def experiment_with(self, derived: dict | None = None):
        """The run's experiment: the preset as planned, ``derived`` keys, then the planned overrides."""
        from pipeline_steps.training import experiment

        return experiment.from_plan(self.to_dict(), derived)


@dataclasses.dataclass(frozen=True)
class EvaluationPlan:
    """A ``verl_evaluate_model`` run's plan (:func:`pipeline_steps.planning.evaluation.evaluation_plan`): which model,
    which evaluation data, and the evaluate step's argv."""

    backend: str
    store: str
    model: str
    data: str
    run_key: str
    dag_id: str
    run_id: str
    steps: dict
    carry: dict

    @classmethod
    def from_dict(cls, d: dict) -> EvaluationPlan:
        if isinstance(d, EvaluationPlan):
            return d
        kw = _take(d, cls, "evaluation plan")
        _check_backend(kw["backend"], "evaluation plan")
        return cls(**kw)

    def to_dict(self) -> dict:
        return _dict(self)

    @property
    def layout(self) -> RunLayout:
        return RunLayout.for_store(self.store)

    def template(self, step: str) -> list[str]:
        if step not in self.steps:
            raise UserError(f"evaluation plan: no {step!r} step in it ({sorted(self.steps)})")
        return list(self.steps[step])


def from_dict(d: dict) -> RunPlan | EvaluationPlan:
    """Either plan from its dict: a pipeline run's (it has a ``preset``) or the evaluation DAG's."""
    if isinstance(d, (RunPlan, EvaluationPlan)):
        return d
    if isinstance(d, dict) and "preset" in d:
        return RunPlan.from_dict(d)
    return EvaluationPlan.from_dict(d)
