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
from pipeline_steps.planning import plan as planning
from pipeline_steps.uris import strip_file_scheme

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
    @task(task_id="plan")
    def plan(params=None, triggering_asset_events=None, run_id=None) -> dict:
        """Which model and which evaluation parquet, as arguments for the evaluate step."""
        import json

        from airflow.sdk.exceptions import AirflowFailException

        from operators.failures import user_errors
        from operators.hooks.store_connection import store_environment
        from pipeline_steps.store import open_store

        store_root = (params.get("store_uri") or planning.default_store()).rstrip("/")
        model = params.get("model_uri")
        if not model and triggering_asset_events:
            events = [e for evs in triggering_asset_events.values() for e in evs]
            model = events[-1].asset.uri if events else ""
        if not model:
            raise AirflowFailException(
                "model_uri: empty and no exported-model event triggered this run; name a model to evaluate"
            )
        data = params.get("eval_data_uri")
        if not data:
            with store_environment(STORE_CONN_ID, store_root), user_errors():  # the worker reads the store itself
                pointer = open_store(store_root).read_bytes(
                    f"{store_root}/datasets/{params['eval_dataset']}/last_processed.json"
                )
            if pointer is None:
                raise AirflowFailException(
                    f"eval_dataset {params['eval_dataset']!r}: no processed version in {store_root}; "
                    "run verl_grpo_pipeline with it first or pass eval_data_uri"
                )
            data = json.loads(pointer)["uri"].rstrip("/") + "/test.parquet"
        out = f"{settings.home() / 'work' / 'evaluations' / planning.run_key(run_id)}"
        args = [
            "--model",
            strip_file_scheme(model),
            "--data",
            strip_file_scheme(data),
            "--output",
            out,
            "--k",
            str(params["k"]),
            "--temperature",
            str(params["temperature"]),
            "--top-p",
            str(params["top_p"]),
            "--max-new-tokens",
            str(params["max_new_tokens"]),
        ]
        return {"args": args, "carry": {"model": model, "data": data}, "store": store_root}

    planned = plan()
    PipelineStepJobOperator(  # in the worker; model and data on a cloud store are fetched into its local mirror
        task_id="evaluate",
        step="evaluate",
        backend="local",
        request=planned,
        uri_args=("--model", "--data"),
        store_uri="{{ ti.xcom_pull(task_ids='plan')['store'] }}",
        store_conn_id=STORE_CONN_ID,
        pool="gpu",
        pool_slots=1,
    )


dag = verl_evaluate_model()
