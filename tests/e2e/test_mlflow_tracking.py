"""MLflow experiment tracking, for real: the embedded tracking server (SQLite), a short CPU training logging through
verl's ``Tracking`` with ``trainer.logger`` holding ``mlflow``, read back through MLflow's own client.

The metric names in MLflow must be those of the file logger's lines (after verl's MLflow key sanitising, which turns
``@`` into ``_at_``), at the same steps and values: a local run and a cluster run then chart the same names.

The embedded server wants its generated credentials (issue 46; the refusals: tests/e2e/test_local_service_auth.py):
the clients here get them as the pipeline's do, through MLflow's ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, and the
browser through its HTTP credentials.
"""

from __future__ import annotations

import base64
import json
import math
import os

import pytest

from tests.helpers.eval_results import LINEAGE, export_results
from tests.helpers.train_local_runs import run_cli, train_local_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipeline_steps.local import mlflow_server

    d = tmp_path_factory.mktemp("mlflow")
    uri = mlflow_server.ensure_server(d)
    creds = mlflow_server.client_env(d)
    saved = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)  # this process's clients and the steps it starts (run_cli passes its environment on)
    try:
        yield uri, d
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        mlflow_server.shutdown_server(d)


def test_server_is_reused_not_started_twice(server):
    from pipeline_steps import tracking_run
    from pipeline_steps.local import mlflow_server

    uri, d = server
    assert mlflow_server.ensure_server(d) == uri
    assert tracking_run.responds(uri)


def test_training_metrics_reach_mlflow_under_the_file_logger_names(server, assets, tmp_path):  # noqa: F811
    from mlflow.tracking import MlflowClient
    from verl.utils.tracking import _MlflowLoggingAdapter

    from pipeline_steps import metrics_log

    uri, _ = server
    out = tmp_path / "run"
    args = train_local_args(assets, out, steps=2)
    args += ["--override", "trainer.experiment_name=mlflow_test"]
    proc = run_cli(*args, env={"MLFLOW_TRACKING_URI": uri, "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    run_id = summary["mlflow"]["run_id"]
    assert run_id and summary["mlflow"]["tracking_uri"] == uri
    assert summary["mlflow"]["url"] == f"{uri}/#/experiments/{summary['mlflow']['experiment_id']}/runs/{run_id}"

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "verl_grpo_pipeline"  # trainer.project_name
    assert run.info.run_name == "mlflow_test"  # trainer.experiment_name
    assert run.data.params["trainer/total_training_steps"] == "2"  # verl logs the composed config as params

    sanitize = _MlflowLoggingAdapter()._sanitize_key
    lines = metrics_log.read(out / "metrics.jsonl").by_step()
    assert sorted(lines) == [1, 2]
    expected = {sanitize(k) for data in lines.values() for k in data}
    assert "critic/score/mean" in expected and "actor/pg_loss" in expected
    assert set(run.data.metrics) == expected
    for name in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "timing_s/step"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, name)}
        assert sorted(history) == [1, 2], name
        for step, value in history.items():
            want = float(lines[step][name])
            assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-9), (name, step, value, want)

    # export finds the run beside the checkpoints (no MLFLOW_TRACKING_URI needed) and adds the evaluation and card
    (tmp_path / "lineage.json").write_text(json.dumps(LINEAGE))
    (tmp_path / "results.json").write_text(json.dumps(export_results(0.5)))
    (tmp_path / "base.json").write_text(json.dumps(export_results(0.25)))
    exp = run_cli(
        "export",
        *("--checkpoint-dir", str(out / "checkpoints"), "--output", str(tmp_path / "export")),
        *("--store-root", f"file://{tmp_path}/store", "--experiment", "local_tiny"),
        *("--lineage", str(tmp_path / "lineage.json"), "--eval-results", str(tmp_path / "results.json")),
        *("--base-results", str(tmp_path / "base.json")),
        env={"MLFLOW_TRACKING_URI": ""},
    )
    assert exp.returncode == 0, exp.stderr[-3000:]
    assert json.loads(exp.stdout.strip().splitlines()[-1])["mlflow"]["run_id"] == run_id
    card = (tmp_path / "export" / "model" / "README.md").read_text()
    assert f"[`{run_id}`]({summary['mlflow']['url']})" in card
    run = client.get_run(run_id)
    assert run.data.metrics["eval/avg_at_k"] == 0.5 and run.data.metrics["eval_base/avg_at_k"] == 0.25
    assert run.data.metrics["export/promoted"] == 1.0
    # the prior baseline and the answer distribution beside avg@k (what shows a collapsed model)
    assert run.data.metrics["eval/best_constant"] == 0.1 and run.data.metrics["eval/non_modal_avg_at_k"] == 0.5
    assert run.data.metrics["eval_base/non_modal_avg_at_k"] == 0.25 and run.data.metrics["eval/majority_distinct"] == 9
    assert {a.path for a in client.list_artifacts(run_id)} >= {"README.md", "export.json"}
    logged_card = client.download_artifacts(run_id, "README.md", str(tmp_path / "dl"))
    assert open(logged_card).read() == card


def test_without_a_tracking_uri_mlflow_is_skipped_with_a_warning(assets, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    proc = run_cli(*train_local_args(assets, out, steps=1), env={"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MLFLOW_TRACKING_URI is not set" in proc.stderr
    assert json.loads((out / "train_summary.json").read_text())["mlflow"] is None


def test_the_local_server_serves_the_web_ui_and_the_run_pages_data(server, tmp_path):
    """The full mlflow package's UI (mlflow-skinny had none): the index page and its script, the REST data the run
    page reads (``ajax-api``, as the UI calls it), and, in Debian's Chromium, the run page showing the run."""
    import re
    import shutil
    import urllib.request

    from mlflow.tracking import MlflowClient

    from pipeline_steps import tracking_run

    uri, d = server
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(f"ui-{tmp_path.name}")
    run_id = client.create_run(exp_id, run_name="ui-run-name").info.run_id
    for step, value in ((1, 0.25), (2, 0.5)):
        client.log_metric(run_id, "critic/score/mean", value, step=step)

    from pipeline_steps.local import mlflow_server

    creds = mlflow_server.client_env(d)
    user, password = creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"]
    basic = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    def get(url: str):
        return urllib.request.urlopen(urllib.request.Request(url, headers=basic), timeout=30)

    with get(uri + "/") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        html = r.read().decode()
    assert "<title>MLflow</title>" in html and 'id="root"' in html
    script = re.search(r'src="(static-files/static/js/main\.[0-9a-f]+\.js)"', html).group(1)
    with get(f"{uri}/{script}") as r:  # the app itself is served too
        assert r.status == 200 and "javascript" in r.headers["Content-Type"] and len(r.read()) > 100_000

    def ajax(path: str) -> dict:
        with get(f"{uri}/ajax-api/2.0/mlflow/{path}") as r:
            return json.loads(r.read())

    run = ajax(f"runs/get?run_id={run_id}")["run"]
    assert run["info"]["run_name"] == "ui-run-name" and run["info"]["experiment_id"] == exp_id
    history = ajax(f"metrics/get-history?run_id={run_id}&metric_key=critic/score/mean")["metrics"]
    assert [(m["step"], m["value"]) for m in history] == [(1, 0.25), (2, 0.5)]

    chromium = shutil.which("chromium")
    if not chromium:  # the HTTP checks above stand; the rendering needs Debian's chromium (.ci/run installs it)
        pytest.skip("Debian's chromium is not installed: the run page was not rendered")
    from playwright.sync_api import sync_playwright

    from tests.helpers.chromium import CHROMIUM_ARGS

    page_url = tracking_run.url(uri, run_id, exp_id)  # the link the XCom, the card and the report carry
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(http_credentials={"username": user, "password": password})  # asked for once
            page.goto(page_url, timeout=120_000)
            page.get_by_text("ui-run-name").first.wait_for(timeout=120_000)
            page.get_by_text(run_id).first.wait_for(timeout=30_000)  # the run's own page, not a list
            page.screenshot(path=str(tmp_path / "run-page.png"))
        finally:
            browser.close()
