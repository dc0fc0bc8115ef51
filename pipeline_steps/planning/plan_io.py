"""A run's plan saved to and read from its ``plan.json`` (the run layout's ``plan_file``).

Every later task reads the plan from the ``plan`` task's XCom; a step given ``--plan`` (``train-local``,
``render-rayjob``, ``preflight``) reads it from the file, as a :class:`~pipeline_steps.planning.run_plan.RunPlan`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.planning.run_plan import RunPlan


def save(run: dict, credentials: Mapping[str, str] | None = None) -> str:
    """Write the plan to ``plan.json`` in the run directory (one atomic write: a reader sees all of it or none);
    returns its URI. ``credentials``: the store client's (the worker's connection); without them, the environment's."""
    from pipeline_steps.store import open_store

    plan = RunPlan.from_dict(run)
    uri = plan.layout.plan_file
    body = json.dumps(plan.to_dict(), indent=2, sort_keys=True).encode()
    open_store(plan.store, credentials=credentials).write_bytes(uri, body)
    return uri


def load(run_dir: str) -> dict:
    """The plan a run's ``plan`` task wrote to its run directory."""
    return load_file(RunLayout.for_run_dir(run_dir).plan_file)


def load_file(path_or_uri: str) -> dict:
    """A plan from its ``plan.json`` (a local path, or a store URI); a step given ``--plan`` reads it here. Refused in
    one line when it is not there, not JSON, or not a whole plan (a missing key named)."""
    from pipeline_steps.store import open_store

    uri = str(path_or_uri) if "://" in str(path_or_uri) else f"file://{Path(path_or_uri).resolve()}"
    data = open_store(uri).read_bytes(uri)
    if data is None:
        raise UserError(f"{uri}: no plan there; the run's plan task writes it first")
    try:
        run = json.loads(data)
    except ValueError:
        raise UserError(f"{uri}: not a plan (invalid JSON)") from None
    if not isinstance(run, dict) or not isinstance(run.get("preset"), dict):
        raise UserError(f"{uri}: not a run plan (no preset in it); pass the plan.json the plan task wrote")
    try:
        return RunPlan.from_dict(run).to_dict()
    except UserError as exc:
        raise UserError(f"{uri}: {exc}") from None


def load_plan(path_or_uri: str, overrides: list[str] | None = None) -> RunPlan:
    """The run's plan from its ``plan.json`` (a step's ``--plan``); a step's own ``--override`` would change the
    planned run, so it is refused."""
    if overrides:
        raise UserError("--override: a plan holds its run's overrides; pass --experiment to add your own")
    return RunPlan.from_dict(load_file(path_or_uri))


def experiment_from_file(path_or_uri: str, overrides: list[str] | None = None, derived: dict | None = None):
    """The run's experiment from its ``plan.json`` (a step's ``--plan``): the preset as planned, no preset file
    read."""
    return load_plan(path_or_uri, overrides).experiment_with(derived)
