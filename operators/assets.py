"""Register dataset and model versions as Airflow Assets, one registration at a time across all runs.

Why a task of its own that runs alone: Airflow 3.3 creates an Asset that an AssetAlias event names for the first time
inside the API server's task-success call (``TaskInstance.register_asset_changes_in_db``: look the Asset up, insert it
when missing), with nothing for a concurrent creator. Runs that produce the same version (a backfill whose dates share
a dataset revision, two runs exporting the same weights) both insert it; on PostgreSQL the second insert fails on
``idx_asset_name_uri_unique`` and the API server marks that task *failed*, without a retry and with nothing in the
task's own log. With ``max_active_tis_per_dag=1`` the scheduler runs one registration task of the DAG at a time, so
the next one starts only after the previous success (and the Asset it created) is committed. The work itself
(upload, export) stays parallel; only this small task queues.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.sdk import BaseOperator


def asset_name(uri: str) -> str:
    """A readable Asset name for a store version: ``gsm8k@00f2904 (9007d73)`` for a dataset version
    (``datasets/<name>/<commit>/<content hash>``), ``<experiment>@<version>`` for an exported model."""
    parts = uri.split("://", 1)[-1].strip("/").split("/")
    if len(parts) >= 4 and parts[-4] == "datasets":
        return f"{parts[-3]}@{parts[-2][:7]} ({parts[-1][:7]})"
    if len(parts) >= 3 and parts[-3] == "exported":
        return f"{parts[-2]}@{parts[-1]}"
    return "/".join(parts[-3:])


class RegisterAssetsOperator(BaseOperator):
    """Emit each step result's output (``result[summary_key]["uri"]``) as an Asset through an AssetAlias.

    :param asset_alias: the AssetAlias to emit through (declared as this task's outlet).
    :param results: one step result or a list of them (a mapped task's output), as
        :class:`operators.step.PipelineStepOperator` returns them: ``{**carry, summary_key: summary}``.
    :param summary_key: where the step's summary sits in a result (``upload``, ``export``).
    :param max_active_tis_per_dag: 1 (the default and the point, see the module docstring).
    """

    template_fields: Sequence[str] = ("results",)
    ui_color = "#fdf3e1"

    def __init__(self, *, asset_alias: str, results, summary_key: str, max_active_tis_per_dag: int = 1, **kwargs):
        from airflow.sdk import AssetAlias

        super().__init__(outlets=[AssetAlias(asset_alias)], max_active_tis_per_dag=max_active_tis_per_dag, **kwargs)
        self.asset_alias, self.results, self.summary_key = asset_alias, results, summary_key

    def execute(self, context) -> list[str]:
        from airflow.sdk import Asset, AssetAlias

        # a mapped task's results: sliced (one request); iterating probes past the end, and Airflow's client logs
        # that 404 at ERROR in a successful task's log
        results = [self.results] if isinstance(self.results, dict) else list((self.results or [])[:])
        emitted = []
        for result in results:
            summary = dict(result.get(self.summary_key) or {})
            uri = summary.get("uri")
            if not uri:
                continue
            made = {k: result[k] for k in ("dataset", "revision") if k in result}
            pre = result.get("preprocess") or {}  # a dataset version: its rows and content hash
            made.update({k: pre[k] for k in ("rows_out", "content_hash") if k in pre})
            extra = {k: v for k, v in {**made, **summary}.items() if isinstance(v, (str, int, float, bool))}
            extra.pop("uri", None)
            extra.update({k: v for k, v in (("dag_id", self.dag_id), ("run_id", context.get("run_id"))) if v})
            name = asset_name(uri)
            context["outlet_events"][AssetAlias(self.asset_alias)].add(Asset(uri=uri, name=name), extra=extra)
            self.log.info("emitting asset %s (%s) via alias %s", name, uri, self.asset_alias)
            emitted.append(uri)
        if emitted:
            # What a user needs if the server refuses the success report anyway (it is then marked failed with no
            # error after this line): the cause is in the API server's log, and clearing this task only registers.
            self.log.info(
                "registering %d asset(s) with this task's success; if the task ends failed after this line, the API "
                "server refused the registration (its log names why): clear this task to register again, the "
                "uploaded data is kept",
                len(emitted),
            )
        return emitted
