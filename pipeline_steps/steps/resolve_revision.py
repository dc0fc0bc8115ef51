"""``python -m pipeline_steps resolve-revision --dataset NAME --as-of DATE``: a dataset's commit as of a date
(see :mod:`pipeline_steps.data.revisions`)."""

from __future__ import annotations

from pipeline_steps.data import registry
from pipeline_steps.data.revisions import parse_date, resolve
from pipeline_steps.errors import UserError


def add_arguments(p):
    p.add_argument("--dataset", required=True)
    p.add_argument("--as-of", required=True, help="ISO-8601 date or datetime (the run's logical date)")
    p.add_argument("--registry", default=None)


def run(args):
    spec = registry.get(args.dataset, args.registry)
    if not spec.repo_id:
        raise UserError(f"--dataset {spec.name} has no Hub repository to resolve")
    return {"dataset": spec.name, **resolve(spec.repo_id, parse_date(args.as_of))}
