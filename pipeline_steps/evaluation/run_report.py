"""The run report: one page per run, with the training curves, the evaluation against the base and the lineage.

Inputs, read from the run directory, each optional: a missing one is shown as "not produced", an unreadable one as
"unreadable" with the reason; neither stops the report.

* ``metrics.jsonl``: verl's ``FileLogger`` lines, ``{"step": N, "data": {"critic/score/mean": x, ...}}``
  (the same shape from the cluster's verl and from :mod:`pipeline_steps.local.grpo_cpu`). A line that is not such
  an object is skipped and counted; when a step appears twice (a resumed run) the later line wins.
* ``eval/results.json`` and ``eval/base_results.json`` (the evaluate step: :mod:`pipeline_steps.evaluation.eval_run`).
* ``eval/figures/NNNN.png``: thumbnails of the evaluated figures, shown beside the answers (re-encoded by the report,
  inlined as ``data:`` URIs; :mod:`pipeline_steps.evaluation.figures`).
* ``lineage.json`` (shape at the top of :mod:`pipeline_steps.evaluation.model_card`).
* ``train_summary.json`` (:mod:`pipeline_steps.steps.train_local`); without it (a cluster run) the MLflow run's
  record ``checkpoints/mlflow_run.json`` (:mod:`pipeline_steps.training.verl_main`).
* ``tensorboard/``: where verl's tensorboard logger wrote (the report names it and the command to view it).

Output (one atomic directory, default ``<run-dir>/report/``): ``report.md``, one PNG per curve made with
matplotlib's Agg canvas, and ``report.html`` (the same Markdown rendered by markdown-it-py with raw HTML
disabled, images inlined, a Content-Security-Policy that lets it load nothing else) when markdown-it-py is
installed. Every value read from those inputs (model answers, ground truths, ids, names, the run's overrides) is
escaped for where it lands (:mod:`pipeline_steps.evaluation.markdown`): the page links only what the pipeline gives
it. The page holds no timestamp, so a retry writes the same bytes.

On a cloud store the run's few small inputs are fetched from an open store (:func:`write_remote_report`) into a
local copy, the report is written next to it and uploaded to ``<run dir>/report/`` as a version.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from pipeline_steps import atomic, outputs, tracking_run
from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import figures, trajectories
from pipeline_steps.evaluation.markdown import cell, code
from pipeline_steps.evaluation.model_card import _get
from pipeline_steps.evaluation.report_inputs import parse_task_states, read_json
from pipeline_steps.evaluation.report_markup import render_html
from pipeline_steps.evaluation.report_sections import (
    MAX_PROBLEM_ROWS,
    eval_section,
    lineage_section,
    links_section,
    metrics_section,
    tasks_section,
    training_section,
)
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.uris import local_path

log = logging.getLogger(__name__)


def validate_links(dashboard_url: str, exported_uri: str) -> None:
    if dashboard_url:
        parts = urlsplit(dashboard_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or re.search(r"\s", dashboard_url):
            raise UserError(
                f"--dashboard-url {dashboard_url[:80]!r}: expected an http:// or https:// URL; "
                "pass the Ray dashboard address or leave it out"
            )
    if exported_uri and (re.search(r"[\s\x00-\x1f]", exported_uri) or len(exported_uri) > 2000):
        raise UserError(
            f"--exported-uri {exported_uri[:80]!r}: contains whitespace or control characters (or is too long); "
            "pass the store URI of the exported model"
        )


# the run directory's files the report reads (RunLayout's names for them), fetched from a cloud store
REMOTE_INPUTS = (
    "metrics",
    "lineage",
    "train_summary",
    "mlflow_record",  # a cluster run's MLflow record (no train_summary.json there)
    "eval_results",
    "base_results",
)
# verl's rollout dump is one file per step and a big run's steps are tens of MB each: the report fetches the newest
# ones only (its table then starts there; the samples shown are the last step's anyway)
REMOTE_ROLLOUT_STEPS = 20


def write_remote_report(
    store, uri: str, run_dir_arg: str, output: str | None, dashboard_url: str, exported_uri: str, task_states: str
) -> dict:
    """The report of the run at ``uri`` in ``store`` (an open cloud store), uploaded to ``<uri>/report/``."""
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:
        local = Path(tmp) / "run"
        local.mkdir()
        remote, here = RunLayout.for_run_dir(uri), RunLayout.for_run_dir(str(local))
        for name in REMOTE_INPUTS:  # absent inputs are reported as "not produced", as locally
            data = store.read_bytes(getattr(remote, name))
            if data is not None:
                Path(getattr(here, name)).parent.mkdir(parents=True, exist_ok=True)
                Path(getattr(here, name)).write_bytes(data)
        fetch_rollouts(store, remote.rollouts, Path(here.rollouts))
        fetch_figures(store, remote.eval_figures, Path(here.eval_figures))
        tb_uri = remote.tensorboard
        tb = tracking_run.tensorboard_info(tb_uri) if store.list_names(tb_uri) else None
        out = Path(tmp) / "report"
        summary = write_report(
            run_dir_arg,
            output,
            dashboard_url,
            exported_uri,
            task_states,
            run_dir=local,
            out=out,
            shown_dir=uri,
            tensorboard=tb,
        )
        upload = store.upload_dir(str(out), remote.report, replace=True)  # regenerated on re-runs
    report_uri = remote.report
    summary.update(
        report=f"{report_uri}/report.md",
        html=f"{report_uri}/report.html" if summary.get("html") else None,
        plots=[f"{report_uri}/{Path(x).name}" for x in summary["plots"]],
        uploaded=upload.get("uploaded"),
    )
    return summary


def fetch_figures(store, prefix: str, dest: Path) -> None:
    """The evaluated figures' thumbnails the report shows (the first rows of its per-problem table only)."""
    wanted = {figures.name(i) for i in range(MAX_PROBLEM_ROWS)}
    for name in sorted(n for n in store.list_names(prefix) if n in wanted):
        data = store.read_bytes(f"{prefix}/{name}")
        if data is not None and len(data) <= 4 * figures.MAX_BYTES:
            dest.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)


def fetch_rollouts(store, prefix: str, dest: Path) -> None:
    """The newest ``<step>.jsonl`` files of verl's ``trainer.rollout_data_dir``; none (no directory) when the run
    dumped no rollouts, so the report then has no Trajectories section, as locally."""
    steps = sorted(
        (n for n in store.list_names(prefix) if n.endswith(".jsonl") and n[:-6].isdigit()), key=lambda n: int(n[:-6])
    )
    for name in steps[-REMOTE_ROLLOUT_STEPS:]:
        data = store.read_bytes(f"{prefix}/{name}")
        if data is not None:
            dest.mkdir(exist_ok=True)
            (dest / name).write_bytes(data)


def write_report(
    run_dir_arg: str,
    output: str | None,
    dashboard_url: str,
    exported_uri: str,
    task_states: str,
    run_dir: Path | None = None,
    out: Path | None = None,
    shown_dir: str | None = None,
    tensorboard=None,
) -> dict:
    """Write the report of a local run directory; the arguments are the step's (``--run-dir`` as given, ...).

    :param run_dir: the directory to read instead of ``run_dir_arg`` (a fetched copy), shown as ``shown_dir``
    :param out: the report directory instead of ``output`` / ``<run dir>/report``
    """
    run_dir = run_dir or local_path(run_dir_arg, "--run-dir")
    states = parse_task_states(task_states)
    if not run_dir.exists() and states:  # the DAG's planned run directory; the run stopped before making it
        run_dir.mkdir(parents=True)
    if not run_dir.is_dir():
        raise UserError(
            f"--run-dir {run_dir_arg}: not a directory; pass the run directory that holds metrics.jsonl and eval/"
        )
    layout = RunLayout.for_run_dir(str(run_dir))
    out = out or (local_path(output, "--output") if output else Path(layout.report))
    outputs.refuse_overlap(out, {"--run-dir": run_dir}, allow_inside=True)  # report/ inside the run dir is its place
    validate_links(dashboard_url, exported_uri)
    lin, _ = read_json(Path(layout.lineage))
    title_bits = [str(x) for x in (_get(lin or {}, "experiment", "name", default=None), (lin or {}).get("run_id")) if x]
    title = "Run report" + (": " + " · ".join(title_bits) if title_bits else "")
    state: dict = {"inputs": {}, "plots": [], "metrics_steps": 0, "metrics_skipped_lines": 0}
    with atomic.atomic_dir(out, owner="report") as tmp:
        sections = [f"# {cell(title)}", "", f"Run directory {code(shown_dir or run_dir, table=False)}.", ""]
        sections += tasks_section(states)
        sections += metrics_section(run_dir, tmp, state)
        sections += eval_section(run_dir, state, tmp)
        sections += trajectories.report_section(run_dir, state)
        sections += lineage_section(run_dir, state)
        sections += training_section(run_dir, state, tensorboard)
        sections += links_section(dashboard_url, exported_uri)
        sections += ["## Inputs", "", "| file | status |", "| --- | --- |"]
        sections += [f"| `{name}` | {cell(status)} |" for name, status in state["inputs"].items()] + [""]
        text = "\n".join(sections) + "\n"
        atomic.write_text(tmp / "report.md", text)
        page = render_html(text, tmp, title)
        if page is not None:
            atomic.write_text(tmp / "report.html", page)
    report = out / "report.md"
    log.info("run report written to %s", report)
    return {
        "report": str(report),
        "html": str(out / "report.html") if page is not None else None,
        "plots": [str(out / p) for p in state["plots"]],
        "inputs": state["inputs"],
        "metrics_steps": state["metrics_steps"],
        "metrics_skipped_lines": state["metrics_skipped_lines"],
    }
