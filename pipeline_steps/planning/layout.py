"""Where everything of a run is: :class:`RunLayout`, the one home of a run's locations and of the store keys the tasks
hand each other.

A run directory (``<store>/runs/<experiment>/<run key>``, a store URI or a local path) holds::

    plan.json            the run's plan (the plan task)
    lineage.json         data and model lineage (collect_inputs)
    metrics.jsonl        verl's file logger ($VERL_FILE_LOGGER_PATH)
    checkpoints/         trainer.default_local_dir; mlflow_run.json beside the shards
    rollouts/            trainer.rollout_data_dir: per-step generations
    tensorboard/         $TENSORBOARD_DIR
    train_summary.json   the CPU trainer's summary
    eval/                the evaluate step's output (results.json, base_results.json)
    report/              the run report

and the store root, beside the runs, the keys tasks that share nothing but the store hand each other (snapshots,
processed data, dataset versions, the baseline cache, the evaluation DAG's results, a dataset's last processed version).

Pure string joins (``/``), no I/O, no imports beyond the shared modules (the names of verl's metrics file and of the
MLflow record): the DAG files use it at parse time.
"""

from __future__ import annotations

import dataclasses
import posixpath

from pipeline_steps import metrics_log, tracking_run

RUNS = "runs"
PLAN_FILE = "plan.json"
LINEAGE_FILE = "lineage.json"
METRICS_FILE = metrics_log.FILE_NAME  # verl's file logger's lines
CHECKPOINTS = "checkpoints"
ROLLOUTS = "rollouts"
TENSORBOARD = "tensorboard"
EVAL = "eval"
EVAL_RESULTS = "results.json"
BASE_RESULTS = "base_results.json"
EVAL_FIGURES = "figures"  # thumbnails of the evaluated figures (image rows)
TRAIN_SUMMARY = "train_summary.json"
REPORT = "report"
MLFLOW_RECORD = tracking_run.FILE  # the MLflow record beside the checkpoints


def _join(base: str, *parts: str) -> str:
    """``base/part/...``; a relative base that is empty (``""``, ``.``) adds nothing, the root keeps its ``/``."""
    base = str(base)
    if base in ("", "."):
        return "/".join(parts)
    return "/".join([base.rstrip("/"), *parts])


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """A run's locations. ``store``: the store root (``file:///...``, ``gs://...``; None for a reader that has only the
    run directory and no store key to find); ``run_dir``: the run directory (None for a plan with no run directory,
    the evaluation DAG's); ``work``: the worker's work directory (caches that are not handed over);
    ``checkpoints_dir``: the checkpoint directory's name in the run directory (another than ``checkpoints`` only for
    a layout found from a checkpoint directory named otherwise, :meth:`for_checkpoints`)."""

    store: str | None = None
    run_dir: str | None = None
    work: str | None = None
    checkpoints_dir: str = CHECKPOINTS

    def __post_init__(self):
        for name in ("store", "run_dir", "work"):
            value = getattr(self, name)
            if value is not None and str(value) != "/":
                object.__setattr__(self, name, str(value).rstrip("/"))

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, store: str, experiment: str, run_key: str, work: str | None = None) -> RunLayout:
        """The layout of a pipeline run: its directory is ``<store>/runs/<experiment>/<run key>``."""
        store = str(store).rstrip("/")
        return cls(store=store, run_dir=f"{store}/{RUNS}/{experiment}/{run_key}", work=work)

    @classmethod
    def for_run_dir(cls, run_dir: str, work: str | None = None) -> RunLayout:
        """The layout of a run known by its directory alone (the report and export steps, a checkpoint's parent):
        the store root is found when the directory is in the ``runs/<experiment>/<key>`` area, else None."""
        run_dir = str(run_dir).rstrip("/") or str(run_dir)
        head, _, _ = run_dir.rpartition("/")  # .../runs/<experiment>
        root, _, _ = head.rpartition("/")  # .../runs
        store = root[: -len(RUNS) - 1] if root.endswith(f"/{RUNS}") else None
        return cls(store=store or None, run_dir=run_dir, work=work)

    @classmethod
    def for_checkpoints(cls, checkpoints: str) -> RunLayout:
        """The layout of the run whose checkpoint directory (``trainer.default_local_dir``) is ``checkpoints``: the
        run's other locations are beside it."""
        checkpoints = str(checkpoints).rstrip("/")
        layout = cls.for_run_dir(posixpath.dirname(checkpoints))
        return dataclasses.replace(layout, checkpoints_dir=posixpath.basename(checkpoints))

    @classmethod
    def for_store(cls, store: str, work: str | None = None) -> RunLayout:
        """The store keys alone (the evaluation DAG's plan, which has no run directory)."""
        return cls(store=str(store).rstrip("/"), work=work)

    def _dir(self) -> str:
        if self.run_dir is None:
            raise ValueError("this layout has no run directory")
        return self.run_dir

    def _store(self) -> str:
        if self.store is None:
            raise ValueError(f"run directory {self.run_dir}: not under a store's runs/ area; no store key to find")
        return self.store

    def _work(self) -> str:
        if self.work is None:
            raise ValueError("this layout has no work directory")
        return self.work

    def relative(self, location: str) -> str:
        """A location below the run directory as a path relative to it (``eval/results.json``): how the report
        names its inputs."""
        return posixpath.relpath(location, self._dir())

    @property
    def run_key(self) -> str:
        """The run directory's last segment (:func:`pipeline_steps.planning.making.run_key`)."""
        return posixpath.basename(self._dir())

    # -- the run directory -----------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> str:
        return _join(self._dir(), self.checkpoints_dir)

    @property
    def metrics(self) -> str:
        return _join(self._dir(), METRICS_FILE)

    @property
    def rollouts(self) -> str:
        return _join(self._dir(), ROLLOUTS)

    @property
    def tensorboard(self) -> str:
        return _join(self._dir(), TENSORBOARD)

    @property
    def eval(self) -> str:
        return _join(self._dir(), EVAL)

    @property
    def eval_results(self) -> str:
        return _join(self._dir(), EVAL, EVAL_RESULTS)

    @property
    def base_results(self) -> str:
        return _join(self._dir(), EVAL, BASE_RESULTS)

    @property
    def eval_figures(self) -> str:
        return _join(self._dir(), EVAL, EVAL_FIGURES)

    @property
    def lineage(self) -> str:
        return _join(self._dir(), LINEAGE_FILE)

    @property
    def plan_file(self) -> str:
        return _join(self._dir(), PLAN_FILE)

    @property
    def train_summary(self) -> str:
        return _join(self._dir(), TRAIN_SUMMARY)

    @property
    def report(self) -> str:
        return _join(self._dir(), REPORT)

    @property
    def mlflow_record(self) -> str:
        return _join(self.checkpoints, MLFLOW_RECORD)

    # -- the worker's work directory (caches, not handed over) -------------------------------------------------
    @property
    def snapshot_cache(self) -> str:
        return _join(self._work(), "snapshots")

    @property
    def export_output(self) -> str:
        return _join(self._work(), "export", self.run_key)

    # -- store keys the tasks hand each other -----------------------------------------------------------------
    @property
    def snapshots(self) -> str:
        """The download step's ``--store-dest``: it commits ``<snapshots>/<name>/<commit>`` (:meth:`snapshot`)."""
        return _join(self._store(), "snapshots")

    def snapshot(self, name: str, commit: str) -> str:
        return _join(self.snapshots, name, commit)

    def processed(self, name: str, commit: str, tag: str) -> str:
        """The preprocess step's output for one dataset revision and row variant (``tag``)."""
        return _join(self._store(), "cache", "processed", name, commit, tag)

    def dataset_version(self, name: str, commit: str, content_hash: str) -> str:
        """A dataset version in the store (the upload step's destination)."""
        return _join(self._store(), "datasets", name, commit, content_hash)

    def last_processed(self, name: str) -> str:
        """The pointer to a dataset's last processed version (what verl_evaluate_model reads)."""
        return _join(self._store(), "datasets", name, "last_processed.json")

    @property
    def baseline_cache(self) -> str:
        """The base model's evaluation results, shared by runs (reachable from pods)."""
        return _join(self._store(), "cache", "baseline")

    def evaluation(self, key: str) -> str:
        """The verl_evaluate_model run's results in the store."""
        return _join(self._store(), "evaluations", key)
