"""``python -m tests.helpers.count_plan_calls <airflow CLI args>``: Airflow's CLI with counters on what a run should
derive once (tests/test_user_jsonl_dag.py). ``airflow dags test`` runs every task in this process, so the counters see
the plan task, ``collect_inputs``, the operators and the request tasks; a step's own child process is not counted.

Counted: reading a preset (``experiment.read``, or ``experiment.load`` where there is no ``read``), resolving the
backend (``constants.resolve_backend``) and turning the form into verl overrides (``overrides`` of the form's
module). Written as JSON to ``$PIPELINE_CALL_COUNTS`` when the process exits.
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


def dump() -> None:
    path = os.environ.get("PIPELINE_CALL_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump({"counts": dict(COUNTS), "where": WHERE}, f, indent=2, sort_keys=True)


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

    atexit.register(dump)


if __name__ == "__main__":
    install()
    from airflow.__main__ import main

    sys.argv = ["airflow", *sys.argv[1:]]
    sys.exit(main())
