"""Check the cluster before the first GPU run: ``python -m pipeline_steps doctor`` from the Airflow UI.

Trigger it by hand with a preset and namespace. It runs as the worker's service account (in-cluster credentials,
as the ``kubernetes_default`` connection of k8s/airflow/values.yaml), with the store and MLflow connections' settings
in its environment as the pipeline's own steps get them. The task log holds the checklist, one ``[ok]``/``[FAIL]``
line per check with its fix; the task fails (without retries) when any check fails. Checks this account may not make
(listing nodes or Deployments cluster-wide, reading Secrets) are reported as not checked.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag

from operators.step import PipelineStepOperator
from pipeline_steps import settings
from pipeline_steps.training import experiment

PRESETS = experiment.preset_names()
# a deployment's default preset when it sets one; else a cluster preset (the settings' default is the local one)
DEFAULT = (
    settings.get(settings.DEFAULT_EXPERIMENT) if settings.is_set(settings.DEFAULT_EXPERIMENT) else "gsm8k_qwen2_5_3b"
)
STORE_CONN_ID = settings.get(settings.STORE_CONN_ID)
MLFLOW_CONN_ID = settings.get(settings.MLFLOW_CONN_ID)


@dag(
    dag_id="verl_doctor",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["verl", "cluster"],
    params={
        "experiment": Param(
            DEFAULT if DEFAULT in PRESETS else PRESETS[0],
            enum=PRESETS,
            title="Experiment preset",
            description="Its Secrets, GPU request, sandbox service and MLflow logger are checked.",
        ),
        "namespace": Param(
            "verl-pipeline",
            type="string",
            pattern="^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
            title="Namespace",
            description="Where the RayJobs run.",
        ),
        "store_uri": Param(
            settings.get(settings.STORE_URI),
            type=["null", "string"],
            pattern="^(file|oss|gs)://[A-Za-z0-9._/-]+$",
            title="Store root URI",
            description="Listed with the store connection's credentials; empty = not checked.",
        ),
    },
    doc_md=__doc__,
)
def verl_doctor():
    PipelineStepOperator(
        task_id="doctor",
        step="doctor",
        request={
            "args": [
                "--namespace",
                "{{ params.namespace }}",
                "--experiment",
                "{{ params.experiment }}",
                "--store-uri",
                "{{ params.store_uri or '' }}",
            ]
        },
        store_uri="{{ params.store_uri or '' }}",
        store_conn_id=STORE_CONN_ID,
        hf_conn_id=None,
        mlflow_conn_id=MLFLOW_CONN_ID,
        retries=0,  # a failed check is the cluster's state: asking again at once changes nothing
        execution_timeout=timedelta(minutes=10),
    )


dag = verl_doctor()
