"""verl GRPO post-training, one run as retryable tasks:

plan -> download -> preprocess -> upload_dataset (mapped per dataset) ─┬-> register_datasets
     -> stage_model ───────────────────────────────────────────────────┴-> collect_inputs -> train -> evaluate
     -> export -> register_model, report (runs even when an earlier task failed)

Declarative only: the work lives in ``pipeline_steps`` (plain Python, run as ``python -m pipeline_steps ...``) and
the Airflow side in ``operators``. Nothing heavy is imported here: the scheduler re-parses this file constantly.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, TriggerRule, dag, task

from operators.assets import RegisterAssetsOperator
from operators.cluster_step import PipelineStepJobOperator
from operators.notify import notify_failure
from operators.step import PipelineStepOperator
from operators.train import GRPOTrainOperator
from pipeline_steps import settings
from pipeline_steps.planning import argv_templates, form, plan_io, run_requests
from pipeline_steps.planning import plan as planning
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.training import experiment
from pipeline_steps.uris import strip_file_scheme

PRESETS = experiment.preset_names(offered=True)  # a preset marked form: false is for another entry point
SCHEDULE = settings.get(settings.SCHEDULE)
END_DATE = settings.get(settings.END_DATE)  # ISO date: no scheduled runs after it (optional)
GPU_POOL = settings.get(settings.GPU_POOL)
GPU_SLOTS = settings.get_int(settings.GPU_SLOTS)
POLL_SECONDS = settings.get_float(settings.POLL_SECONDS)  # how often a job's status is read
DATASET_ASSETS = "verl-processed-datasets"  # AssetAlias: one Asset per processed dataset version
MODEL_ASSETS = "verl-exported-models"  # AssetAlias: one Asset per exported model version (verl_evaluate_model listens)
STORE_CONN_ID = settings.get(settings.STORE_CONN_ID)
MLFLOW_CONN_ID = settings.get(settings.MLFLOW_CONN_ID)  # a team's MLflow server, if it exists


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


DEFAULT_EXPERIMENT = settings.get(settings.DEFAULT_EXPERIMENT)  # what scheduled runs train
DEFAULT_BACKEND = settings.get(settings.DEFAULT_BACKEND)
PRESET = form.preset_summary(DEFAULT_EXPERIMENT)  # the default preset's values, shown in the form
NAME = "^[a-z0-9][a-z0-9_.-]{0,63}$"
# a JSONL file: a store object or a Hub dataset file (HfFileSystem's spelling, optional @revision after the repo)
JSONL_URI = r"^(file:///|(oss|gs)://|hf://datasets/)[A-Za-z0-9._/@%=-]+\.jsonl$"


def _default(what: str) -> str:
    return f"empty = the preset's ({DEFAULT_EXPERIMENT}: {PRESET.get(what) or 'none'})"


def _form_fields(*names: str) -> dict[str, Param]:
    """The form's fields that set verl keys, built from their one table (pipeline_steps/planning/form.py)."""
    fields = {name: form.FIELDS[name] for name in names}
    return {
        name: Param(None, **f.schema, title=f.title, section=f.section, description=f.lead + _default(name))
        for name, f in fields.items()
    }


# The trigger form. Airflow's form marks a field required unless its schema allows null, so every optional field
# is ["null", <type>] with a None default: the form's Trigger button works with the defaults. What a schema cannot
# check (an override's key, batch sizes against GPUs) is caught by the plan task and the CPU pre-flight.
PARAMS = {
    "experiment": Param(
        DEFAULT_EXPERIMENT,
        enum=PRESETS,
        title="Experiment preset",
        section="Experiment",
        description="What to train and where: a preset names the model, datasets, cluster shape and verl settings.",
    ),
    "backend": Param(
        DEFAULT_BACKEND,
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
        None,
        type=["null", "array"],
        items={"type": "string", "pattern": NAME},
        uniqueItems=True,
        maxItems=form.MAX_ITEMS,
        title="Training datasets",
        section="Data",
        description="Which data, at which revision. Registry names; " + _default("datasets"),
    ),
    "train_jsonl": Param(
        None,
        type=["null", "string"],
        pattern=JSONL_URI,
        maxLength=form.MAX_TEXT,
        title="Training JSONL file",
        section="Data",
        description="Your own data, trained on instead of the preset's datasets (with them if listed above): one "
        '{"messages": [...], "rollout_extra": {"solution": ...}} per line; file:///abs/x.jsonl, oss://bucket/x.jsonl, '
        "gs://bucket/x.jsonl or hf://datasets/org/name[@revision]/x.jsonl.",
    ),
    "validation_jsonl": Param(
        None,
        type=["null", "string"],
        pattern=JSONL_URI,
        maxLength=form.MAX_TEXT,
        title="Validation JSONL file",
        section="Data",
        description="Optional, with a training JSONL file: its validation split, the same form of URI and rows.",
    ),
    "prepare_datasets": Param(
        None,
        type=["null", "array"],
        items={"type": "string", "pattern": NAME},
        uniqueItems=True,
        maxItems=form.MAX_ITEMS,
        title="Also prepare",
        section="Data",
        description="Datasets to download, preprocess and upload (a new version) without training on them.",
    ),
    "eval_dataset": Param(
        None,
        type=["null", "string"],
        pattern=NAME,
        maxLength=64,
        title="Evaluation set",
        section="Data",
        description=_default("eval_dataset"),
    ),
    "dataset_revisions": Param(
        None,
        type=["null", "object"],
        additionalProperties={"type": "string", "pattern": "^[A-Za-z0-9._/-]{1,128}$", "maxLength": 128},
        propertyNames={"pattern": NAME},
        maxProperties=form.MAX_ITEMS,
        title="Pinned dataset revisions",
        section="Data",
        description='{"gsm8k": "<commit>"}; unpinned datasets resolve to their newest commit at the logical date.',
    ),
    "variant": Param("default", enum=["default", "tool_agent"], title="Row variant", section="Data"),
    "revisions_as_of_logical_date": Param(
        True, type="boolean", title="Resolve revisions as of the logical date", section="Data"
    ),
    "model": Param(
        None,
        type=["null", "string"],
        pattern="^(tiny|[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$",
        maxLength=193,  # a Hub repo id: 96 characters of owner, 96 of name
        title="Model",
        section="Model",
        description="The base model to post-train: Hugging Face repo id (org/name) or 'tiny'; " + _default("model"),
    ),
    "model_revision": Param(
        None,
        type=["null", "string"],
        pattern="^[A-Za-z0-9._/-]{1,128}$",
        maxLength=128,
        title="Model revision",
        section="Model",
        description="Branch, tag or commit; empty = main for a model typed here, else the preset's "
        f"({PRESET.get('model_revision') or 'main'}).",
    ),
    **_form_fields("learning_rate", "rollout_n", "train_batch_size", "total_training_steps", "kl_coef"),
    "verl_overrides": Param(
        None,
        type=["null", "array"],
        items=form.OVERRIDE_ITEM,  # KEY=VALUE with KEY from the reviewed table (types and ranges: the plan task)
        maxItems=form.MAX_OVERRIDES,
        title="verl overrides",
        section="Hyperparameters",
        description="KEY=VALUE verl overrides, applied last, for the keys the form may set: hyperparameters, lengths, "
        "sampling, cadence, logging (pipeline_steps/training/form_keys.py, each with its range). Paths, ray_kwargs, "
        "trust_remote_code and every other key come only from a preset ($PIPELINE_PRESETS_DIR).",
    ),
    **_form_fields("nnodes", "gpus_per_node"),
    "store_uri": Param(
        None,
        type=["null", "string"],
        pattern="^(file|oss|gs)://[A-Za-z0-9._/-]+$",
        maxLength=form.MAX_TEXT,
        title="Store root URI",
        section="Cluster",
        description="file:///path, oss://bucket/prefix or gs://bucket/prefix; empty = the deployment's default.",
    ),
}


@dag(
    dag_id="verl_grpo_pipeline",
    schedule=None if SCHEDULE.lower() in ("", "none", "off") else SCHEDULE,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    end_date=pendulum.parse(END_DATE) if END_DATE else None,
    catchup=False,
    max_active_runs=settings.get_int(settings.MAX_ACTIVE_RUNS),
    params=PARAMS,
    tags=["verl", "grpo", "rl"],
    default_args=retrying(timedelta(hours=1)),
    doc_md=__doc__,
    render_template_as_native_obj=True,
)
def verl_grpo_pipeline():
    @task(task_id="plan", multiple_outputs=True, **retrying(timedelta(minutes=5)))
    def plan(params=None, logical_date=None, run_id=None, dag=None) -> dict:
        """The run's plan, made once: the preset read, the backend resolved, the form's overrides, dataset revisions
        (pinned, or as of the logical date) and every location. Later tasks read it from here (XCom) or plan.json."""
        from operators.failures import user_errors
        from operators.hooks.store_connection import StoreHook

        with user_errors():
            run = planning.plan(dict(params), logical_date, run_id, dag.dag_id)
            plan_io.save(run, StoreHook(STORE_CONN_ID).credentials(run["store"]))  # handed to the store's client
        return {"run": run, "datasets": run["datasets"], "store": run["store"], "model": run["model"]}

    @task(task_id="download_requests", **retrying(timedelta(minutes=5)))
    def download_requests(datasets) -> list[dict]:
        return [run_requests.download_kwargs(item) for item in datasets]

    planned = plan()
    # tasks share nothing but the store (a task may run on a fresh machine): download commits the snapshot to the
    # store, preprocess reads it from there and commits its output, upload reads that
    download = PipelineStepOperator.partial(
        task_id="download",
        step="download",
        store_conn_id=STORE_CONN_ID,
        **retrying(timedelta(hours=2)),
    ).expand_kwargs(download_requests(planned["datasets"]))
    preprocess = PipelineStepOperator.partial(
        task_id="preprocess",
        step="preprocess",
        store_uri=planned["store"],
        store_conn_id=STORE_CONN_ID,
        **retrying(timedelta(hours=2)),
    ).expand(request=download.output.map(run_requests.preprocess_request))
    upload_dataset = PipelineStepOperator.partial(
        task_id="upload_dataset",
        step="upload",
        store_uri=planned["store"],
        store_conn_id=STORE_CONN_ID,
        **retrying(timedelta(hours=2)),
    ).expand(request=preprocess.output.map(run_requests.upload_request))
    # Assets are registered by a task of their own that runs one at a time across runs (why: operators/assets.py)
    RegisterAssetsOperator(
        task_id="register_datasets",
        asset_alias=DATASET_ASSETS,
        results=upload_dataset.output,
        summary_key="upload",
        **retrying(timedelta(minutes=10)),
    )
    stage_model = PipelineStepOperator(
        task_id="stage_model",
        step="stage-model",
        request=planned["model"],
        store_uri=planned["store"],
        store_conn_id=STORE_CONN_ID,
        **retrying(timedelta(hours=3)),
    )

    @task(task_id="collect_inputs", multiple_outputs=True, **retrying(timedelta(minutes=10)))
    def collect_inputs(uploaded, staged, run) -> dict:
        """Training and evaluation inputs, and the run's lineage (stored with the run for the model card)."""
        import json

        from operators.failures import user_errors
        from operators.hooks.store_connection import StoreHook

        with user_errors():
            # a slice is one request; iterating a mapped task's results probes past the end, and Airflow's client
            # logs that 404 at ERROR in a successful task's log
            inputs = run_requests.collect(list(uploaded[:]), staged, run)
        layout = RunLayout(store=run["store"], run_dir=run["run_dir"])
        lineage_uri = layout.lineage
        with user_errors():  # the store's client is handed the connection's credentials
            store = StoreHook(STORE_CONN_ID).open(run["store"])
            store.write_bytes(lineage_uri, json.dumps(inputs["lineage"], indent=2, sort_keys=True).encode())
            for d in inputs["lineage"]["datasets"]:  # what verl_evaluate_model reads when no eval data is given
                store.write_bytes(layout.last_processed(d["name"]), json.dumps(d, sort_keys=True).encode())
        return {**inputs, "lineage_uri": lineage_uri, "run_dir": run["run_dir"], "run": run}

    inputs = collect_inputs(upload_dataset.output, stage_model.output, planned["run"])
    train = GRPOTrainOperator(
        task_id="train",
        plan=inputs["run"],  # the preset, backend and overrides as planned
        train_files=inputs["train_files"],
        val_files=inputs["val_files"],
        model_path=inputs["model_uri"],
        run_dir=inputs["run_dir"],
        store_conn_id=STORE_CONN_ID,
        mlflow_conn_id=MLFLOW_CONN_ID,
        poll_interval=POLL_SECONDS,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS,
        **retrying(timedelta(hours=48)),
    )

    @task(task_id="evaluate_request", **retrying(timedelta(minutes=5)))
    def evaluate_request(inputs, trained) -> dict:
        return run_requests.evaluate_request(inputs, trained, inputs["run"])

    @task(task_id="export_request", **retrying(timedelta(minutes=5)))
    def export_request(inputs, trained, evaluated) -> dict:
        lineage = strip_file_scheme(inputs["lineage_uri"])
        return run_requests.export_request(inputs, trained, inputs["run"], evaluated, lineage)

    @task(task_id="report_request", trigger_rule=TriggerRule.ALL_DONE, **retrying(timedelta(minutes=5)))
    def report_request(ti=None) -> dict:
        """Runs whatever happened upstream: a missing result is reported as such, not fatal."""
        from airflow.sdk.exceptions import AirflowSkipException

        from operators.links import DASHBOARD_XCOM_KEY
        from operators.run_tasks import task_states

        run = ti.xcom_pull(task_ids="plan", key="run")
        if not run:
            raise AirflowSkipException("plan did not finish: no run directory to report on (see the plan task's log)")
        return run_requests.report_request(
            run,
            ti.xcom_pull(task_ids="train"),
            ti.xcom_pull(task_ids="export"),
            ti.xcom_pull(task_ids="train", key=DASHBOARD_XCOM_KEY),
            task_states(ti),
        )

    # local backend: in the worker; kuberay: as a RayJob next to the checkpoint (GPU for evaluate)
    on_backend = {
        "plan": planned["run"],  # the backend, the preset (cluster shape, image, mounts) and overrides as planned
        "store_uri": planned["store"],
        "store_conn_id": STORE_CONN_ID,
        "poll_interval": POLL_SECONDS,
    }
    evaluate = PipelineStepJobOperator(
        task_id="evaluate",
        step="evaluate",
        request=evaluate_request(inputs, train.output),
        **argv_templates.job_flags("evaluate"),  # which flags are store URIs, and which the step writes
        **on_backend,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS,
        **retrying(timedelta(hours=6)),
    )
    export = PipelineStepJobOperator(
        task_id="export",
        step="export",
        skip_unless="promoted",
        **argv_templates.job_flags("export"),
        mlflow_conn_id=MLFLOW_CONN_ID,  # export logs the evaluation and the model card to the training's run
        **on_backend,
        request=export_request(inputs, train.output, evaluate.output),
        **retrying(timedelta(hours=3)),
    )
    RegisterAssetsOperator(  # every exported version, promoted or not (a skipped export pushed its result)
        task_id="register_model",
        trigger_rule=TriggerRule.NONE_FAILED,
        asset_alias=MODEL_ASSETS,
        results=export.output,
        summary_key="export",
        **retrying(timedelta(minutes=10)),
    )
    report_args = report_request()
    export >> report_args
    PipelineStepOperator(
        task_id="report",
        step="report",
        trigger_rule=TriggerRule.ALL_DONE,
        request=report_args,
        store_uri=planned["store"],  # an oss:// or gs:// run directory is read and written with the connection
        store_conn_id=STORE_CONN_ID,
        **retrying(timedelta(minutes=20)),
    )


dag = verl_grpo_pipeline()
