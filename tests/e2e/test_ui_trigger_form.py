"""The trigger form, in a real browser, the way a user starts a run from the UI.

Real parts: `make airflow` itself, run as a user runs it (scripts/airflow_local.py: the local profile, an MLflow server
and Airflow's components under a supervisor that restarts one that exits),
Airflow's own React UI, Debian's Chromium driven by Playwright for Python, a run's plan made on the local profile.
Screenshots land in ``$UI_SCREENSHOTS`` (default: the test's temporary directory), named form-defaults.png and
form-refused-*.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from tests.helpers import listening
from tests.helpers.airflow_api import api, login_url
from tests.helpers.chromium import CHROMIUM_ARGS
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.browser]
SUPERVISOR = "/scripts/airflow_components.py"  # the parent of Airflow's components, below make airflow


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """`make airflow` as a user runs it (in a session of its own, so the test can clean up whatever survives), and a
    Chromium; the module's last test stops it with SIGTERM, teardown only cleans up after a failure."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: apt-get install -y chromium (.ci/run does it)"
    tmp = tmp_path_factory.mktemp("ui")
    shots = Path(os.environ.get("UI_SCREENSHOTS") or tmp / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    home, port = tmp / "pipeline", free_port()
    env = dict(
        os.environ,
        PIPELINE_HOME=str(home),
        AIRFLOW_HOME=str(tmp / "airflow-home"),
        PIPELINE_AIRFLOW_PORT=str(port),
        # only the runs this test triggers; no end date (a DAG end date in the past leaves a new run with no tasks)
        PIPELINE_SCHEDULE="none",
        PIPELINE_END_DATE="",
    )
    for name in ("MLFLOW_TRACKING_URI", "PIPELINE_AIRFLOW_HOST"):  # make airflow's own defaults
        env.pop(name, None)
    out = tmp / "make-airflow.out"
    make = listening.start_make("airflow", env, out)
    from playwright.sync_api import sync_playwright

    try:
        listening.wait_for_output(make, out, "Airflow UI:", 600)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300  # the DAG processor parses the DAG files
        while time.time() < deadline:
            try:
                api(url, "/dags/verl_grpo_pipeline")
                break
            except OSError:
                time.sleep(3)
        below = psutil.Process(make.pid).children(recursive=True)
        (supervisor,) = [p for p in below if p.cmdline()[1:2] and p.cmdline()[1].endswith(SUPERVISOR)]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            yield {
                "url": url,
                "browser": browser,
                "shots": shots,
                "home": home,
                "log": home / "standalone.log",  # the components' supervisor's log
                "supervisor": supervisor.pid,
                "make": make,
                "port": port,
            }
            browser.close()
    finally:
        if make.poll() is None:  # the last test did not get to stop it
            make.terminate()
            try:
                make.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(make.pid, signal.SIGKILL)  # only what the test started (its own session), if anything is left
        except ProcessLookupError:
            pass
        from pipeline_steps.local import mlflow_server, ray_cluster
        from scripts.local_profile import ray_temp_dir

        ray_cluster.shutdown_cluster(ray_temp_dir(home))
        mlflow_server.shutdown_server(home / "mlflow")
        make.wait(timeout=30)


def _open_form(ui):
    page = ui["browser"].new_page(viewport={"width": 1400, "height": 1400})
    page.goto(login_url(ui["url"]))  # the link make airflow prints: one click logs the browser in
    page.wait_for_url(f"{ui['url']}/", timeout=60_000)
    page.goto(f"{ui['url']}/dags/verl_grpo_pipeline", wait_until="networkidle")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Trigger Dag - verl_grpo_pipeline").wait_for()
    return page, dialog


def _section(page, dialog, name: str) -> None:
    """Open a section of the form and wait until it is open (a condition, not a fixed pause)."""
    from playwright.sync_api import expect

    button = dialog.get_by_role("button", name=name)
    if button.get_attribute("aria-expanded") != "true":
        button.click()
    expect(button).to_have_attribute("aria-expanded", "true", timeout=15000)


def test_the_form_opens_with_every_section_valid_and_trigger_enabled(ui):
    page, dialog = _open_form(ui)
    for name in ("Experiment", "Data", "Model", "Hyperparameters", "Cluster"):
        assert dialog.get_by_role("button", name=name).is_visible()
    assert dialog.get_by_role("button", name="Trigger").is_enabled()
    _section(page, dialog, "Data")
    assert "local_tiny: gsm8k" in dialog.inner_text()  # the preset's values show where they apply
    page.screenshot(path=str(ui["shots"] / "form-defaults.png"), full_page=True)
    page.close()


@pytest.mark.parametrize(
    "section,selector,value,param",
    [
        ("Hyperparameters", "[name=element_rollout_n]", "0", "rollout_n"),
        ("Cluster", "#element_store_uri", "ftp://x", "store_uri"),
        ("Hyperparameters", "#element_verl_overrides", "no equals sign", "verl_overrides"),
        ("Data", "#element_train_jsonl", "ftp://host/rows.jsonl", "train_jsonl"),
    ],
    ids=["rollout-n-0", "store-ftp", "override-without-equals", "train-jsonl-ftp"],
)
def test_bad_values_are_refused_with_their_message_visible(ui, section, selector, value, param):
    before = api(ui["url"], "/dags/verl_grpo_pipeline/dagRuns")["total_entries"]
    page, dialog = _open_form(ui)
    _section(page, dialog, section)
    from playwright.sync_api import expect

    field = dialog.locator(selector)
    field.fill(value)
    field.press("Tab")
    if param == "rollout_n":  # the number field refuses 0 by clamping to the schema's minimum as the user leaves it
        expect(field).to_have_value("1", timeout=15000)
        page.screenshot(path=str(ui["shots"] / f"form-refused-{param}.png"), full_page=True)
        page.close()
        assert api(ui["url"], "/dags/verl_grpo_pipeline/dagRuns")["total_entries"] == before
        return
    expect(field).to_have_value(value)
    dialog.get_by_role("button", name="Trigger").click()
    alert = dialog.get_by_text(f"Invalid input for param {param}")
    alert.wait_for(timeout=15000)
    assert alert.is_visible()
    page.screenshot(path=str(ui["shots"] / f"form-refused-{param}.png"), full_page=True)
    page.close()
    assert api(ui["url"], "/dags/verl_grpo_pipeline/dagRuns")["total_entries"] == before  # nothing was started


def _components(supervisor: int, name: str) -> list:

    # [python, .../bin/airflow, <component>, options...]: the scheduler runs with --skip-serve-logs
    return [c for c in psutil.Process(supervisor).children() if c.cmdline()[2:3] == [name]]


def test_a_scheduler_that_dies_is_restarted_and_schedules_the_next_run(ui):
    """`airflow standalone` leaves a dead scheduler dead, and Airflow 3's scheduler does exit on known races (a
    StaleDataError on dag_run, seen here when a backfill was created from the UI); `make airflow` restarts it. The
    run of the next test is then scheduled by the restarted scheduler."""
    (scheduler,) = _components(ui["supervisor"], "scheduler")
    workers = scheduler.children(recursive=True)  # the LocalExecutor's worker processes
    assert workers, "the scheduler has no LocalExecutor workers to leave behind"
    killed_at = time.time()
    scheduler.kill()
    deadline, healthy = time.time() + 180, None
    while time.time() < deadline:
        health = api(ui["url"], "/monitor/health")["scheduler"]
        beat = health.get("latest_scheduler_heartbeat")
        if health["status"] == "healthy" and beat and datetime.fromisoformat(beat).timestamp() > killed_at + 1:
            healthy = health
            break
        time.sleep(3)
    assert healthy, (health, Path(ui["log"]).read_text()[-3000:])
    (again,) = _components(ui["supervisor"], "scheduler")
    assert again.pid != scheduler.pid
    log = Path(ui["log"]).read_text()
    assert "scheduler exited with code -9; restarting it" in log
    # as a pod restart would, the restart took the dead scheduler's workers with it (they once piled up by the dozen)
    alive = [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"the killed scheduler's workers {alive} outlived it"
    killed = [int(n) for n in re.findall(r"killed (\d+) process\(es\) left behind by an exited component", log)]
    assert killed and killed[0] >= len(workers), (killed, len(workers))


def test_a_run_triggered_from_the_form_is_planned_with_the_forms_values(ui):
    """The form's values reach the run: its conf, and the plan its first task makes (the overrides every later task
    launches with). The run is then stopped: a whole scheduled smoke run through `make airflow` is
    tests/e2e/test_scheduling.py's backfill (two of them, on this same code path), and costs minutes of make
    test's two cores."""
    known = {r["dag_run_id"] for r in api(ui["url"], "/dags/verl_grpo_pipeline/dagRuns")["dag_runs"]}
    page, dialog = _open_form(ui)
    _section(page, dialog, "Experiment")
    dialog.get_by_text("Smoke run").click()
    _section(page, dialog, "Hyperparameters")
    dialog.locator("[name=element_rollout_n]").fill("2")
    dialog.get_by_role("button", name="Trigger").click()
    page.close()
    deadline = time.time() + 60
    runs = []
    while time.time() < deadline and not runs:
        runs = [
            r
            for r in api(ui["url"], "/dags/verl_grpo_pipeline/dagRuns")["dag_runs"]
            if r["dag_run_id"] not in known and r["run_type"] == "manual"
        ]
        time.sleep(1)
    assert len(runs) == 1, runs
    run = runs[0]
    assert run["conf"]["smoke"] is True and run["conf"]["rollout_n"] == 2  # what the form sent
    path = f"/dags/verl_grpo_pipeline/dagRuns/{urllib.request.quote(run['dag_run_id'], safe='')}"
    deadline, plan = time.time() + 600, {}
    while time.time() < deadline:
        plan = api(ui["url"], f"{path}/taskInstances/plan")
        if plan["state"] in ("success", "failed", "upstream_failed"):
            break
        time.sleep(3)
    assert plan["state"] == "success", (plan, Path(ui["log"]).read_text()[-4000:])
    planned = api(ui["url"], f"{path}/taskInstances/plan/xcomEntries/run?deserialize=true")["value"]
    planned = json.loads(planned) if isinstance(planned, str) else planned
    assert planned["experiment"] == "local_tiny" and planned["smoke"] is True, planned
    assert "actor_rollout_ref.rollout.n=2" in planned["overrides"], planned["overrides"]
    api(ui["url"], path, "PATCH", {"state": "failed"}, idempotent=True)  # as a user stops it (Mark run as failed)
    deadline, live = time.time() + 300, ["?"]
    while time.time() < deadline and live:
        tis = api(ui["url"], f"{path}/taskInstances?limit=100")["task_instances"]
        live = [t["task_id"] for t in tis if t["state"] in ("running", "queued", "deferred", "up_for_retry")]
        time.sleep(2)
    assert not live, f"tasks still running after the run was marked failed: {live}"


def test_make_airflow_listens_on_loopback_and_stops_everything_on_sigterm(ui):
    """Last in the module (it stops the Airflow the tests above used): `make airflow`'s Airflow, MLflow server and the
    local Ray cluster a train task would start on its profile listen on the loopback address only, and SIGTERM to
    the `make` process leaves none of their processes alive."""
    from pipeline_steps.local import ray_cluster
    from scripts.local_profile import local_profile_env, ray_temp_dir

    make, home = ui["make"], ui["home"]
    profile = local_profile_env(home)
    old = {k: os.environ.get(k) for k in profile}
    os.environ.update(profile)
    try:
        ray_cluster.ensure_cluster(num_cpus=1)  # its own session; make airflow stops it
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    ray_state = ray_cluster._read_state(ray_temp_dir(home))

    def ours() -> set[int]:
        return listening.descendants(make.pid) | listening.in_session(ray_state["pgid"])

    socks = listening.wait_listening(ours, ui["port"], timeout=60)
    assert any(a.endswith(f":{ui['port']}") for a in socks), socks
    # Airflow's API server, MLflow, Ray: the ports of at least these three
    assert len({a.rsplit(":", 1)[1] for a in socks}) >= 3, socks
    assert listening.not_loopback(socks) == [], f"make airflow listens beyond the loopback: {socks}"

    started = ours()
    names = {Path(f"/proc/{p}/comm").read_text().strip() for p in listening.alive(started)}
    assert len(started) >= 8, names  # make, the launcher, the supervisor, four components, MLflow, Ray's
    make.send_signal(signal.SIGTERM)
    make.wait(timeout=120)
    deadline = time.monotonic() + 30
    while listening.alive(started) and time.monotonic() < deadline:
        time.sleep(1)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in listening.alive(started)}
    assert not left, f"alive after SIGTERM to make airflow: {left}"
