"""Run a pipeline step (``python -m pipeline_steps <step> ...``) from Airflow.

The step runs in a child process: the worker never imports torch, verl or ray, memory is returned when the step
ends, and the command is the one a user would type in a shell or a pod. Arguments are an argv list (never a shell
string), so values typed into the trigger form cannot break out of their argument. Secrets reach the child only
through its environment, built from Airflow Connections.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from operators.hooks.huggingface import hf_env
from operators.hooks.store_connection import store_env
from pipeline_steps.log_levels import LineLevels


class PipelineStepOperator(BaseOperator):
    """Run one pipeline step as a child process and push its JSON summary as the task's XCom.

    :param step: step name, as in ``python -m pipeline_steps --help``.
    :param request: ``{"args": [...], "carry": {...}}``: the step's argv, and context that is merged into the
        returned value so the next mapped task knows which dataset it is working on.
    :param store_uri: store root; when set, the store connection's environment is passed to the step.
    :param store_conn_id: Airflow connection for object storage (OSS or GCS credentials).
    :param hf_conn_id: Airflow connection holding a Hugging Face token.
    :param mlflow_conn_id: an MLflow connection (:class:`operators.hooks.mlflow.MlflowHook`) whose server URI and
        credentials the step gets in its environment (export: it logs to the training's MLflow run); none by default.
    :param summary_key: key under which the step summary is added to ``carry`` (default: the step name).
    :param skip_unless: summary key; when the step succeeds with that key false, the summary is still pushed and
        the task is marked skipped with the summary's ``reason`` (export: "not promoted" is not a failure).

    Exit code 2 (bad input) fails the task without retries: retrying the same input cannot help.
    Any other failure raises normally so the task's retries apply.
    """

    template_fields: Sequence[str] = ("request", "store_uri")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        step: str,
        request: dict | None = None,
        store_uri: str = "",
        store_conn_id: str | None = "pipeline_store",
        hf_conn_id: str | None = "huggingface_default",
        summary_key: str | None = None,
        skip_unless: str | None = None,
        mlflow_conn_id: str | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.skip_unless = skip_unless
        self.step = step
        self.request = request or {}
        self.store_uri = store_uri
        self.store_conn_id = store_conn_id
        self.hf_conn_id = hf_conn_id
        self.mlflow_conn_id = mlflow_conn_id
        self.summary_key = summary_key or step.replace("-", "_")
        self._proc: subprocess.Popen | None = None

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(hf_env(self.hf_conn_id))
        if self.mlflow_conn_id:  # a team's MLflow server (export logs the evaluation and the card to the run)
            from operators.hooks.mlflow import MlflowHook

            env.update(MlflowHook(self.mlflow_conn_id).env())
        if self.store_uri and not self.store_uri.startswith("file://"):
            env.update(store_env(self.store_conn_id, self.store_uri))
        return env

    def command(self, args: list[str]) -> list[str]:
        """The child process: this interpreter running the step's CLI."""
        return [sys.executable, "-m", "pipeline_steps", self.step, *args]

    def execute(self, context):
        args = [str(a) for a in self.request.get("args", [])]
        cmd = self.command(args)
        self.log.info("running: python -m pipeline_steps %s %s", self.step, " ".join(args))
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.child_env(), start_new_session=True
        )
        # stdout is drained in a thread while stderr streams into the task log: reading one pipe to its end
        # first would block a step that fills the other pipe's buffer (64 KiB) until the task times out
        out_chunks: list[str] = []
        reader = threading.Thread(target=lambda: out_chunks.append(self._proc.stdout.read()), daemon=True)
        reader.start()
        last_error = ""
        levels = LineLevels()  # each line at the level the step gave it (Airflow files raw stderr as ERROR)
        for line in self._proc.stderr:  # the step's log, streamed into the task log as it runs
            line = line.rstrip()
            self.log.log(levels.level(line), "%s", line)
            if line.startswith(("error:", "unexpected error")):
                last_error = line
        reader.join()
        stdout = "".join(out_chunks)
        rc = self._proc.wait()
        lines = stdout.strip().splitlines()
        try:
            summary = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            summary = {}
        if rc == 2:
            raise AirflowFailException(
                f"step {self.step}: {summary.get('error') or last_error} (bad input: not retried)"
            )
        if rc != 0:
            raise AirflowException(f"step {self.step} failed with exit code {rc}: {summary.get('error') or last_error}")
        return self.finish(context, summary)

    def finish(self, context, summary: dict) -> dict:
        """A successful step's summary -> the task's result: carry merged in, skip when asked (Assets are emitted
        by :class:`operators.assets.RegisterAssetsOperator` downstream, one registration at a time)."""
        summary.pop("ok", None)
        summary.pop("step", None)
        carry = self.request.get("carry", {})
        result = {**carry, self.summary_key: summary}
        if self.skip_unless and not summary.get(self.skip_unless):
            from airflow.sdk.exceptions import AirflowSkipException

            context["ti"].xcom_push(key="return_value", value=result)
            raise AirflowSkipException(f"step {self.step}: {summary.get('reason') or self.skip_unless + ' is false'}")
        return result

    def on_kill(self):
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
