"""Step ``report``: one page per run, with the training curves, the evaluation against the base and the lineage.

``python -m pipeline_steps report --run-dir DIR [--output DIR] [--dashboard-url URL] [--exported-uri URI]``

The run directory is a local path or a ``file://`` URI (the report is written in place), or a cloud store's
(``oss://``, ``gs://``: its inputs are fetched and the report uploaded to ``<run dir>/report/``). What the report
reads and writes: :mod:`pipeline_steps.evaluation.run_report`.
"""

from __future__ import annotations

# read_metrics and series: the report's metric reading, as tests/test_report.py reaches it through the step
from pipeline_steps.evaluation.report_inputs import read_metrics, series
from pipeline_steps.evaluation.run_report import REMOTE_ROLLOUT_STEPS, write_remote_report, write_report

__all__ = ["REMOTE_ROLLOUT_STEPS", "add_arguments", "read_metrics", "run", "series"]


def add_arguments(p):
    p.add_argument(
        "--run-dir",
        required=True,
        help="the run directory (local path or file:// URI): metrics.jsonl, eval/, lineage.json",
    )
    p.add_argument("--output", help="report directory (default: <run-dir>/report)")
    p.add_argument("--dashboard-url", default="", help="Ray dashboard URL of the training job (http or https)")
    p.add_argument("--exported-uri", default="", help="URI of the exported model (store URI or URL)")
    p.add_argument(
        "--task-states",
        default="",
        help='JSON {"task": "state", ...}: the run\'s tasks as Airflow saw them (the DAG passes it). With it, a run '
        "directory that was never made (the run stopped before training) is reported, not refused",
    )


def run(args) -> dict:
    """On a cloud store (``oss://``, ``gs://``) the run's few small inputs are fetched into a local copy, the report
    is written next to it, and uploaded to ``<run dir>/report/`` as a version; locally it is written in place."""
    fields = (args.run_dir, args.output, args.dashboard_url, args.exported_uri, args.task_states)
    if "://" in args.run_dir and not args.run_dir.startswith("file://"):
        from pipeline_steps.store import open_store

        uri = args.run_dir.rstrip("/")
        return write_remote_report(open_store(uri), uri, *fields)
    return write_report(*fields)
