"""Step ``train-local``: GRPO on CPU, the process that runs inside the local Ray job.

``python -m pipeline_steps train-local --experiment local_tiny --train-files T.parquet
--val-files V.parquet --model-path MODEL --output-dir RUN_DIR [--override K=V ...]``, or, in a pipeline run,
``train-local --plan RUN_DIR/plan.json ...``: the preset and the overrides as the run's ``plan`` task recorded them
(no preset file is read, so a preset edited after ``plan`` does not change the run; a plan whose preset does not
match its ``preset_sha256`` is refused).

Composes verl's config from the preset, the keys derived here (data files, model
path, checkpoint dir) and the user's overrides, then trains with
:mod:`pipeline_steps.local.grpo_cpu`. Outputs, in verl's layout so later steps do not
care which backend trained:

* ``RUN_DIR/checkpoints/latest_checkpointed_iteration.txt`` and
  ``RUN_DIR/checkpoints/global_step_N/actor/`` (FSDP shards + ``huggingface/``);
* verl file-logger JSON lines at ``$VERL_FILE_LOGGER_PATH`` (default ``RUN_DIR/metrics.jsonl``);
* ``RUN_DIR/train_summary.json`` (also the step's JSON summary);

every location as the run's :class:`~pipeline_steps.planning.layout.RunLayout` names it.

Re-running with the same arguments resumes from the latest checkpoint
(``trainer.resume_mode=auto``); a finished run is not trained again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipeline_steps import atomic, library_env, outputs
from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.training import derived_keys as derived

log = logging.getLogger(__name__)


def add_arguments(p):
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--experiment",
        help="preset name (a packaged preset or one in $PIPELINE_PRESETS_DIR) or a YAML file",
    )
    which.add_argument(
        "--plan",
        help="a run's plan.json (path or store URI): its preset and overrides as planned; no preset file is read",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="verl Hydra override; repeatable (with --experiment: a plan holds its run's overrides)",
    )
    p.add_argument("--train-files", nargs="+", required=True, help="verl-schema parquet files for training")
    p.add_argument(
        "--val-files",
        nargs="+",
        default=[],
        help="verl-schema parquet files for validation (used when trainer.test_freq > 0)",
    )
    p.add_argument("--model-path", required=True, help="Hugging Face model directory (config, weights, tokenizer)")
    p.add_argument("--output-dir", required=True, help="run directory: checkpoints/, metrics.jsonl, train_summary.json")


def _local(path) -> str:
    return str(Path(path).resolve())


def derived_keys(train_files, val_files, model_path, output_dir) -> dict:
    """The verl keys this step fixes from its arguments (the user's overrides still win): the run's derived keys
    (:func:`pipeline_steps.training.derived_keys.derived_keys`) as paths on this machine, and the CPU device."""
    layout = RunLayout.for_run_dir(_local(output_dir))
    keys = derived.derived_keys(
        layout, train_files=train_files, val_files=val_files, model_path=model_path, where=_local
    )
    return {**keys, "trainer.device": "cpu"}


def load_experiment(args, derived: dict):
    """The experiment to train: the plan's (``--plan``: no preset file read) or the named preset's."""
    from pipeline_steps.training import experiment

    if args.plan:
        from pipeline_steps.planning import plan_io

        return plan_io.experiment_from_file(args.plan, args.override, derived)
    return experiment.load(args.experiment, args.override, derived=derived)


def _local_inputs(args) -> tuple[list[str], list[str], str]:
    """The inputs as local paths: store URIs (what a pipeline run hands over: tasks share nothing but the store, and
    the job may run on another machine than the task that planned it) are fetched into the local mirror."""
    from pipeline_steps.store import mirror

    train = [str(mirror.step_input(f, "--train-files")) for f in args.train_files]
    val = [str(mirror.step_input(f, "--val-files")) for f in args.val_files]
    return train, val, str(mirror.step_input(args.model_path, "--model-path"))


def run(args) -> dict:
    from pipeline_steps import settings, store
    from pipeline_steps.store import mirror
    from pipeline_steps.training import experiment

    if names := store.load_credentials_file():  # the train task's store connection, for a local job
        log.info("store credentials from $%s: %s", settings.STORE_CREDENTIALS_FILE, ", ".join(sorted(names)))
    train_files, val_files, model_path = _local_inputs(args)
    for f in [*train_files, *val_files]:
        if not Path(f).is_file():
            raise UserError(f"data file {f}: not found; pass parquet files written by the preprocess step")
    if not (Path(model_path) / "config.json").is_file():
        raise UserError(
            f"--model-path {args.model_path}: no config.json there; pass a Hugging Face model directory "
            "(build-tiny-model makes one)"
        )
    out = mirror.step_output(args.output_dir).resolve()
    if mirror.is_remote(args.output_dir) and not out.exists():  # a retry on a fresh machine resumes from the store
        mirror.fetch(args.output_dir)
    outputs.refuse_overlap(
        out,
        {"--model-path": model_path, "--train-files": train_files, "--val-files": val_files},
        what="--output-dir",
    )
    exp = load_experiment(args, derived_keys(train_files, val_files, model_path, out))
    cfg = experiment.compose(exp)
    layout = RunLayout.for_run_dir(str(out))
    metrics_path = os.environ.get(library_env.VERL_FILE_LOGGER_PATH) or layout.metrics

    from pipeline_steps import tracking_run
    from pipeline_steps.local import grpo_cpu

    if tracking_run.load_credentials():  # a team server's, from the train task's MLflow connection
        log.info("MLflow credentials from $%s", tracking_run.CREDENTIALS_FILE_ENV)
    summary = grpo_cpu.train(cfg, metrics_path=metrics_path)
    summary.update(experiment=exp.name, experiment_digest=exp.digest())
    atomic.write_json(layout.train_summary, summary)
    if mirror.is_remote(args.output_dir):  # the run directory is the handoff to evaluate and export
        log.info("run directory committed to %s: %s", args.output_dir, mirror.publish(args.output_dir))
    return summary
