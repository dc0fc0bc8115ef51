"""``python -m pipeline_steps render-rayjob --experiment NAME --output FILE``: the KubeRay RayJob for a preset.

Rendering lives in :mod:`pipeline_steps.training.rayjob_manifest`."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_steps import atomic, outputs
from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.training import experiment
from pipeline_steps.training.derived_keys import derived_keys
from pipeline_steps.training.experiment import Experiment
from pipeline_steps.training.mounts import MountMap
from pipeline_steps.training.rayjob_manifest import build_rayjob, to_yaml


def _mounts_arg(value: str | None, exp: Experiment) -> MountMap:
    if value:
        if value.startswith("@"):
            path = Path(value[1:])
            if not path.is_file():
                raise UserError(f"--mounts {value!r}: file not found; pass JSON or @an-existing-file.json")
            text = path.read_text(encoding="utf-8")
        else:
            text = value
        try:
            return MountMap.from_config(json.loads(text), source="--mounts")
        except json.JSONDecodeError as exc:
            raise UserError(f"--mounts: not valid JSON ({exc.msg}); pass JSON or @file.json") from None
    return MountMap.for_experiment(exp.spec)


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
    p.add_argument("--output", required=True, help="file to write the RayJob YAML to (atomically)")
    p.add_argument(
        "--checkpoint-uri",
        help="the run's checkpoint store URI (trainer.default_local_dir; default with --plan: the run's checkpoints)",
    )
    p.add_argument(
        "--mounts", help="bucket mounts as JSON or @file.json (default: $PIPELINE_MOUNTS, then cluster.mounts)"
    )
    p.add_argument("--dag-id", default="manual")
    p.add_argument("--run-id", default="manual")
    p.add_argument("--task-id", default="train")
    p.add_argument("--namespace", default="default")


def run(args) -> dict:
    mounts_file = args.mounts[1:] if args.mounts and args.mounts.startswith("@") else None
    outputs.refuse_overlap(
        args.output,
        {"--experiment": args.experiment if "/" in (args.experiment or "") else None, "--mounts": mounts_file},
    )
    layout = RunLayout.for_checkpoints(args.checkpoint_uri) if args.checkpoint_uri else None
    if args.plan:  # the run's checkpoints unless --checkpoint-uri names others
        from pipeline_steps.planning import plan_io

        run = plan_io.load_plan(args.plan, args.override)
        exp = run.experiment_with(derived_keys(layout or run.layout))
    else:
        exp = experiment.load(args.experiment, overrides=args.override, derived=layout and derived_keys(layout))
    mounts = _mounts_arg(args.mounts, exp)
    job = build_rayjob(
        exp, dag_id=args.dag_id, run_id=args.run_id, task_id=args.task_id, namespace=args.namespace, mounts=mounts
    )
    atomic.write_text(args.output, to_yaml(job))
    return {
        "output": str(args.output),
        "name": job["metadata"]["name"],
        "namespace": args.namespace,
        "replicas": job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"],
    }
