"""Evaluate a model on demand (form: model URI and evaluation set), and whenever the pipeline exports a new model.

Scheduled on the ``verl-exported-models`` AssetAlias that ``verl_grpo_pipeline``'s export task emits through, so
every exported version is scored; triggered by hand, the form names the model. The evaluation set is the last
processed version of the named dataset in the store (``datasets/<name>/last_processed.json``) unless a parquet URI
is given.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import AssetAlias, Param, dag, task

from operators.cluster_step import PipelineStepJobOperator
from pipeline_steps import settings
from pipeline_steps.planning import argv_templates, evaluation_run
from pipeline_steps.planning import plan as planning

STORE_CONN_ID = settings.get(settings.STORE_CONN_ID)


@dag(
    dag_id="verl_evaluate_model",
    schedule=AssetAlias("verl-exported-models"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["verl", "evaluation"],
    default_args={
        "retries": 2,
        "retry_delay": timedelta(seconds=20),
        "retry_exponential_backoff": True,
        "execution_timeout": timedelta(hours=6),
    },
    params={
        "model_uri": Param(
            "",
            type="string",
            pattern="^((file|oss|gs)://[A-Za-z0-9._/-]+|/[A-Za-z0-9._/-]+)?$",
            title="Model URI",
            description="An exported or staged model (store URI or local path); "
            "empty = the exported model that triggered the run.",
        ),
        "eval_dataset": Param("aime2024", type="string", pattern="^[a-z0-9][a-z0-9_.-]{0,63}$", title="Evaluation set"),
        "eval_data_uri": Param(
            "", type="string", pattern="^((file|oss|gs)://[A-Za-z0-9._/-]+\\.parquet)?$", title="Evaluation parquet URI"
        ),
        "k": Param(4, type="integer", minimum=1, maximum=256, title="Samples per problem"),
        "temperature": Param(1.0, type="number", minimum=0, maximum=2),
        "top_p": Param(1.0, type="number", exclusiveMinimum=0, maximum=1),
        "max_new_tokens": Param(64, type="integer", minimum=1, maximum=32768),
        "store_uri": Param("", type="string", pattern="^((file|oss|gs)://[A-Za-z0-9._/-]+)?$", title="Store root URI"),
    },
    render_template_as_native_obj=True,
    doc_md=__doc__,
)
def verl_evaluate_model():
    @task(task_id="plan", multiple_outputs=True)
    def plan(params=None, triggering_asset_events=None, run_id=None, dag=None) -> dict:
        """The run's plan, made once: which model, which evaluation parquet, and the evaluate step's argv."""
        from operators.failures import user_errors
        from operators.hooks.store_connection import StoreHook

        events = [e for evs in (triggering_asset_events or {}).values() for e in evs]
        store = (params.get("store_uri") or planning.default_store()).rstrip("/")
        with user_errors():  # the store's client is handed the connection's credentials
            run = evaluation_run.evaluation_plan(
                dict(params),
                events[-1].asset.uri if events else None,
                run_id,
                dag.dag_id,
                StoreHook(STORE_CONN_ID).credentials(store),
            )
        return {"run": run, "store": run["store"]}

    planned = plan()
    PipelineStepJobOperator(  # the backend and the argv as planned
        task_id="evaluate",
        step="evaluate",
        plan=planned["run"],
        **argv_templates.job_flags("evaluate"),  # which flags are store URIs, and which the step writes
        store_uri=planned["store"],
        store_conn_id=STORE_CONN_ID,
        pool="gpu",
        pool_slots=1,
    )


dag = verl_evaluate_model()
