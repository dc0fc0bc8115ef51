"""``python -m pipeline_steps preflight --experiment NAME [--override KEY=VALUE ...]``: verl's config checked on CPU.

The checks live in :mod:`pipeline_steps.training.preflight_checks`."""

from __future__ import annotations

from pipeline_steps.training import experiment
from pipeline_steps.training.preflight_checks import preflight


def add_arguments(p):
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--experiment",
        help="preset name (a packaged preset or one in $PIPELINE_PRESETS_DIR) or a YAML file",
    )
    which.add_argument("--plan", help="a run's plan.json (path or store URI): its preset and overrides as planned")
    p.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="verl Hydra override (repeatable)"
    )
    p.add_argument(
        "--skip-store-check",
        action="store_true",
        help="do not check that data files and model are staged in the store (config-only check)",
    )


def run(args) -> dict:
    if args.plan:
        from pipeline_steps.planning import plan_io

        exp = plan_io.experiment_from_file(args.plan, args.override, None)
    else:
        exp = experiment.load(args.experiment, overrides=args.override)
    return preflight(exp, check_store=not args.skip_store_check)
