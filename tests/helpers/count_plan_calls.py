"""``python -m tests.helpers.count_plan_calls <airflow CLI args>``: Airflow's CLI with counters on what a run should
derive once (tests/e2e/test_cloud_store_dag.py). ``airflow dags test`` runs every task in this process, so the counters
see the plan task, ``collect_inputs``, the operators and the request tasks; a step's own child process is not counted.

Counted: reading a preset (``experiment.read``, or ``experiment.load`` where there is no ``read``), resolving the
backend (``constants.resolve_backend``) and turning the form into verl overrides (``overrides`` of the form's
module). Recorded: every step's argv as launched (``PipelineStepOperator.command``, and the local Ray job's
``ray_cluster.job_argv``) and every argv made from the plan's recorded argv (``planning.argv_templates.step_argv``: the
template and its result), so a test can check that each launched step ran the plan's argv. Written as JSON to
``$PIPELINE_CALL_COUNTS`` when the process exits.
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib
import json
import os
import sys
import traceback

COUNTS: collections.Counter = collections.Counter()
WHERE: dict[str, list[str]] = collections.defaultdict(list)
LAUNCHED: list[dict] = []  # {"step": ..., "argv": [...]}: each step process as started
RESOLVED: list[dict] = []  # {"template": [...], "argv": [...]}: each argv made from the plan's


def dump() -> None:
    path = os.environ.get("PIPELINE_CALL_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(
                {"counts": dict(COUNTS), "where": WHERE, "launched": LAUNCHED, "resolved": RESOLVED},
                f,
                indent=2,
                sort_keys=True,
            )


def _count(module, attr: str, name: str) -> None:
    original = getattr(module, attr)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        caller = traceback.extract_stack(limit=3)[0]
        WHERE[name].append(f"{caller.filename.rsplit('/', 2)[-1]}:{caller.lineno} {caller.name}")
        dump()  # as they come: a run stopped half-way still says what it counted
        return original(*args, **kwargs)

    setattr(module, attr, counted)


def install() -> None:
    experiment = importlib.import_module("pipeline_steps.training.experiment")
    _count(experiment, "read" if hasattr(experiment, "read") else "load", "preset_loads")
    _count(importlib.import_module("pipeline_steps.constants"), "resolve_backend", "backend_resolutions")
    # where the form becomes overrides: pipeline_steps.planning.form, or (before issue 25) pipeline_steps.training.plan
    module = "pipeline_steps.planning.form" if hasattr(experiment, "read") else "pipeline_steps.training.plan"
    _count(importlib.import_module(module), "overrides", "overrides_computations")

    _record_argv()
    atexit.register(dump)


def _record_argv() -> None:
    step_op = importlib.import_module("operators.step").PipelineStepOperator
    command = step_op.command

    def launched(self, args):
        LAUNCHED.append({"step": self.step, "argv": [str(a) for a in args]})
        dump()
        return command(self, args)

    step_op.command = launched
    ray_cluster = importlib.import_module("pipeline_steps.local.ray_cluster")
    job_argv = ray_cluster.job_argv

    def job(python=None, *step_argv):
        LAUNCHED.append({"step": step_argv[0], "argv": [str(a) for a in step_argv[1:]]})
        dump()
        return job_argv(python, *step_argv)

    ray_cluster.job_argv = job
    planning = importlib.import_module("pipeline_steps.planning.argv_templates")
    if hasattr(planning, "step_argv"):
        resolve = planning.step_argv

        def resolved(template, facts=None):
            out = resolve(template, facts)
            RESOLVED.append({"template": [str(a) for a in template], "argv": out})
            return out

        planning.step_argv = resolved


def _same(launched: list[str], made: list[str]) -> bool:
    """Equal, up to a cloud store URI given as its local mirror's path: a step the local backend runs reads the
    mirror of a cloud store (operators/cluster_step.py: ``_mirror_inputs``)."""
    if len(launched) != len(made):
        return False
    for have, want in zip(launched, made):
        if have != want and not (
            "://" in want
            and not want.startswith("file://")
            and have.endswith("/mirror/" + want.replace("://", "/", 1).rstrip("/"))
        ):
            return False
    return True


def assert_launched_as_planned(run: dict, recorded: dict, train_attempts: int = 1) -> None:
    """Every step process a whole run launched (``recorded``: this module) ran an argv the plan
    recorded: the plan's own argv, or one made from it by filling in its placeholders (``step_argv``; on a cloud
    store, with the store's URIs read from their local mirror), and the training job got the plan (``--plan``),
    never a preset name, once per attempt of the train task (``train_attempts``: its try number; a retry after a
    failed job launches again, resuming from its checkpoints)."""
    planned: dict[str, list[list[str]]] = {}
    for step, argv in run["steps"].items():
        planned.setdefault(step, []).append(argv)
    for item in run["datasets"]:
        for step, argv in item["steps"].items():
            planned.setdefault(step, []).append(argv)
    made = [(r["template"], r["argv"]) for r in recorded["resolved"]]
    launched = recorded["launched"]
    steps = {x["step"] for x in launched}
    assert {"download", "preprocess", "upload", "stage-model", "train-local", "evaluate", "export", "report"} <= steps
    for x in launched:
        templates = planned.get(x["step"]) or []
        assert x["argv"] in templates or any(t in templates and _same(x["argv"], a) for t, a in made), (x, templates)
    trains = [x["argv"] for x in launched if x["step"] == "train-local"]
    assert len(trains) == train_attempts, f"train-local launched {len(trains)} times in {train_attempts} attempt(s)"
    train = trains[0]
    assert all(t == train for t in trains), trains  # a retry runs the same plan
    assert "--plan" in train and "--experiment" not in train and not any(a.startswith("--override") for a in train)


if __name__ == "__main__":
    install()
    from airflow.__main__ import main

    sys.argv = ["airflow", *sys.argv[1:]]
    sys.exit(main())
