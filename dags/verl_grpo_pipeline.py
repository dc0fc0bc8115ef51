"""verl GRPO post-training: download -> preprocess -> upload_dataset -> stage_model -> train -> evaluate -> export.

Declarative only: the work lives in ``pipeline_steps`` (plain Python, run as ``python -m pipeline_steps ...``) and
the Airflow side in ``operators``. Nothing heavy is imported here: the scheduler re-parses this file constantly.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import Param, TriggerRule, dag, task

from operators.cluster_step import PipelineStepJobOperator
from operators.notify import notify_failure
from operators.step import PipelineStepOperator
from operators.train import GRPOTrainOperator
from pipeline_steps.training import experiment
from pipeline_steps.training import plan as planning

PRESETS = experiment.preset_names()
SCHEDULE = os.environ.get("VERL_PIPELINE_SCHEDULE", "@weekly")
END_DATE = os.environ.get("VERL_PIPELINE_END_DATE")  # ISO date: no scheduled runs after it (optional)
GPU_POOL = os.environ.get("VERL_PIPELINE_GPU_POOL", "gpu")
GPU_SLOTS = int(os.environ.get("VERL_PIPELINE_GPU_SLOTS", "8"))
DATASET_ASSETS = "verl-processed-datasets"  # AssetAlias: one Asset per processed dataset version
MODEL_ASSETS = "verl-exported-models"  # AssetAlias: one Asset per exported model version (verl_evaluate_model listens)
RUN = "{{ ti.xcom_pull(task_ids='plan', key='run')"  # the run-level plan, rendered as a native object
STORE = RUN + "['store'] }}"
INPUTS = "{{ ti.xcom_pull(task_ids='collect_inputs')"
PULL = (
    "ti.xcom_pull(task_ids='collect_inputs'), ti.xcom_pull(task_ids='train'), ti.xcom_pull(task_ids='plan', key='run')"
)


def retrying(timeout: timedelta, retries: int = 2) -> dict:
    """Retries with exponential back-off and a hard execution timeout, for every task."""
    return {
        "retries": retries,
        "retry_delay": timedelta(seconds=20),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
        "execution_timeout": timeout,
        "on_failure_callback": notify_failure,
    }


PARAMS = {
    "experiment": Param(
        "local_tiny",
        enum=PRESETS,
        title="Experiment preset",
        section="Experiment",
        description="dags/experiments/<name>.yaml: model, datasets, cluster shape and verl settings.",
    ),
    "backend": Param(
        "local",
        enum=["local", "kuberay"],
        title="Backend",
        section="Experiment",
        description="local: a local Ray cluster trains on CPU (tiny model). kuberay: a RayJob on GPU nodes.",
    ),
    "smoke": Param(
        False,
        type="boolean",
        title="Smoke run",
        section="Experiment",
        description=f"Train one step on the first {planning.SMOKE_ROWS} rows of each dataset before a long run.",
    ),
    "datasets": Param(
        [],
        type="array",
        items={"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$"},
        uniqueItems=True,
        title="Training datasets",
        section="Data",
        description="Registry names; empty = the preset's.",
    ),
    "prepare_datasets": Param(
        [],
        type="array",
        items={"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$"},
        uniqueItems=True,
        title="Also prepare",
        section="Data",
        description="Datasets to download, preprocess and upload (a new version) without training on them.",
    ),
    "eval_dataset": Param(
        "",
        type="string",
        pattern="^([a-z0-9][a-z0-9_.-]{0,63})?$",
        title="Evaluation set",
        section="Data",
        description="Empty = the preset's (aime2024).",
    ),
    "dataset_revisions": Param(
        {},
        type="object",
        additionalProperties={"type": "string", "pattern": "^[A-Za-z0-9._/-]{1,128}$"},
        title="Pinned dataset revisions",
        section="Data",
        description='{"gsm8k": "<commit>"}; unpinned datasets resolve to their newest commit at the logical date.',
    ),
    "variant": Param("default", enum=["default", "tool_agent"], title="Row variant", section="Data"),
    "model": Param(
        "",
        type="string",
        pattern="^([A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?)?$",
        title="Model",
        section="Model",
        description="Hugging Face repo id (org/name) or 'tiny'; empty = the preset's.",
    ),
    "model_revision": Param(
        "", type="string", pattern="^[A-Za-z0-9._/-]{0,128}$", title="Model revision", section="Model"
    ),
    "learning_rate": Param(
        None, type=["null", "number"], exclusiveMinimum=0, maximum=1, title="Learning rate", section="Hyperparameters"
    ),
    "rollout_n": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        maximum=1024,
        title="Rollouts per prompt (GRPO group size)",
        section="Hyperparameters",
    ),
    "train_batch_size": Param(
        None, type=["null", "integer"], minimum=1, title="Train batch size (prompts)", section="Hyperparameters"
    ),
    "total_training_steps": Param(
        None, type=["null", "integer"], minimum=1, title="Total training steps", section="Hyperparameters"
    ),
    "kl_coef": Param(
        None, type=["null", "number"], minimum=0, title="KL loss coefficient (0 = off)", section="Hyperparameters"
    ),
    "verl_overrides": Param(
        [],
        type="array",
        items={"type": "string", "pattern": r"^\+{0,2}[A-Za-z_][A-Za-z0-9_.]*=.*$"},
        title="verl overrides",
        section="Hyperparameters",
        description="Free-form KEY=VALUE Hydra overrides, applied last; checked by the CPU pre-flight.",
    ),
    "nnodes": Param(None, type=["null", "integer"], minimum=1, maximum=64, title="Nodes", section="Cluster"),
    "gpus_per_node": Param(
        None, type=["null", "integer"], minimum=0, maximum=16, title="GPUs per node", section="Cluster"
    ),
    "store_uri": Param(
        "",
        type="string",
        pattern="^((file|oss|gs)://[A-Za-z0-9._/-]+)?$",
        title="Store root URI",
        section="Cluster",
        description="file:///path, oss://bucket/prefix or gs://bucket/prefix; empty = the deployment's default.",
    ),
    "revisions_as_of_logical_date": Param(
        True, type="boolean", title="Resolve revisions as of the logical date", section="Data"
    ),
}


@dag(
    dag_id="verl_grpo_pipeline",
    schedule=None if SCHEDULE.lower() in ("", "none", "off") else SCHEDULE,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.parse(END_DATE) if END_DATE else None,
    catchup=False,
    max_active_runs=int(os.environ.get("VERL_PIPELINE_MAX_ACTIVE_RUNS", "1")),
    params=PARAMS,
    tags=["verl", "grpo", "rl"],
    default_args=retrying(timedelta(hours=1)),
    doc_md=__doc__,
    render_template_as_native_obj=True,
    user_defined_macros={"planning": planning},
)
def verl_grpo_pipeline():
    @task(task_id="plan", **retrying(timedelta(minutes=5)))
    def plan(params=None, logical_date=None, run_id=None, dag=None, ti=None) -> list[dict]:
        """Resolve dataset revisions (pinned, or as of the logical date) and every location of this run.

        Returns the dataset items to map over; the run-level plan is pushed under the XCom key ``run``.
        """
        from airflow.sdk.exceptions import AirflowFailException

        from pipeline_steps.errors import UserError

        try:
            run = planning.plan(dict(params), logical_date, run_id, dag.dag_id)
        except UserError as exc:
            raise AirflowFailException(str(exc)) from None
        ti.xcom_push(key="run", value=run)
        return run["datasets"]

    datasets = plan()
    download = PipelineStepOperator.partial(
        task_id="download",
        step="download",
        **retrying(timedelta(hours=2)),
    ).expand(request=datasets.map(planning.download_request))
    preprocess = PipelineStepOperator.partial(
        task_id="preprocess",
        step="preprocess",
        **retrying(timedelta(hours=2)),
    ).expand(request=download.output.map(planning.preprocess_request))
    upload_dataset = PipelineStepOperator.partial(
        task_id="upload_dataset",
        step="upload",
        store_uri=STORE,
        asset_alias=DATASET_ASSETS,
        **retrying(timedelta(hours=2)),
    ).expand(request=preprocess.output.map(planning.upload_request))
    stage_model = PipelineStepOperator(
        task_id="stage_model",
        step="stage-model",
        request=RUN + "['model'] }}",
        store_uri=STORE,
        **retrying(timedelta(hours=3)),
    )
    datasets >> stage_model

    @task(task_id="collect_inputs", **retrying(timedelta(minutes=10)))
    def collect_inputs(uploaded, staged, params=None, ti=None) -> dict:
        """Training and evaluation inputs, and the run's lineage (stored with the run for the model card)."""
        import json

        from airflow.sdk.exceptions import AirflowFailException

        from pipeline_steps.errors import UserError
        from pipeline_steps.store import open_store

        run = ti.xcom_pull(task_ids="plan", key="run")
        try:
            inputs = planning.collect(list(uploaded), staged, dict(params), run)
        except UserError as exc:
            raise AirflowFailException(str(exc)) from None
        store = open_store(run["store"])
        lineage_uri = f"{run['run_dir']}/lineage.json"
        store.write_bytes(lineage_uri, json.dumps(inputs["lineage"], indent=2, sort_keys=True).encode())
        for d in inputs["lineage"]["datasets"]:  # what verl_evaluate_model reads when no eval data is given
            store.write_bytes(
                f"{run['store']}/datasets/{d['name']}/last_processed.json", json.dumps(d, sort_keys=True).encode()
            )
        return {**inputs, "lineage_uri": lineage_uri}

    inputs = collect_inputs(upload_dataset.output, stage_model.output)
    train = GRPOTrainOperator(
        task_id="train",
        experiment="{{ params.experiment }}",
        backend="{{ params.backend }}",
        overrides=INPUTS + "['overrides'] }}",
        train_files=INPUTS + "['train_files'] }}",
        val_files=INPUTS + "['val_files'] }}",
        model_path=INPUTS + "['model_uri'] }}",
        run_dir=RUN + "['run_dir'] }}",
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS,
        **retrying(timedelta(hours=48)),
    )
    # local backend: in the worker; kuberay: as a RayJob next to the checkpoint (GPU for evaluate)
    on_backend = {
        "backend": "{{ params.backend }}",
        "experiment": "{{ params.experiment }}",
        "overrides": INPUTS + "['overrides'] }}",
        "store_uri": STORE,
    }
    evaluate = PipelineStepJobOperator(
        task_id="evaluate",
        step="evaluate",
        request="{{ planning.evaluate_request(" + PULL + ", params.backend) }}",
        uri_args=("--model", "--data", "--output", "--base-model", "--baseline-cache"),
        **on_backend,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS,
        **retrying(timedelta(hours=6)),
    )
    export = PipelineStepJobOperator(
        task_id="export",
        step="export",
        asset_alias=MODEL_ASSETS,
        skip_unless="promoted",
        uri_args=("--checkpoint-dir", "--lineage", "--eval-results", "--base-results"),
        **on_backend,
        request="{{ planning.export_request(" + PULL + ", ti.xcom_pull(task_ids='evaluate'), "
        "planning.local_path(ti.xcom_pull(task_ids='collect_inputs')['lineage_uri'])) }}",
        **retrying(timedelta(hours=3)),
    )
    report = PipelineStepOperator(
        task_id="report",
        step="report",
        trigger_rule=TriggerRule.ALL_DONE,
        request="{{ planning.report_request(ti.xcom_pull(task_ids='plan', key='run'), ti.xcom_pull(task_ids='train'), "
        "ti.xcom_pull(task_ids='export'), ti.xcom_pull(task_ids='train', key='ray_dashboard_url')) }}",
        **retrying(timedelta(minutes=20)),
    )
    inputs >> train >> evaluate >> export >> report


dag = verl_grpo_pipeline()
