"""A real Airflow (`make airflow`'s: scheduler with LocalExecutor on SQLite, DAG processor, triggerer, API server,
each restarted if it exits), started and stopped by this module, runs a backfill of ``verl_grpo_pipeline`` over two
weekly logical dates on the local profile in smoke mode, created the way a user creates one: in the UI (Trigger ->
Backfill, the dates in the date pickers, Smoke run switched on), in Debian's Chromium driven by Playwright.
The Hub is replaced by the offline fixture cache whose repositories have dated revisions (gsm8k: v1 on 2026-09-01,
v2 on 2026-10-15), so the runs must record v1 then v2, each processed and uploaded as a version of its own.
That a run on an unchanged revision preprocesses and uploads nothing is shown on the production profile, by
tests/e2e/test_postgres_profile.py's third run on its backfill's revisions: each date here costs a whole-DAG run
of make test's two cores.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.local_profile import xcom
from tests.helpers.airflow_api import api, login_url
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.browser]

DATES = ["2026-10-11", "2026-10-18"]  # Sundays: @weekly logical dates, one before and one after gsm8k v2


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    from scripts.airflow_local import start, stop

    tmp = tmp_path_factory.mktemp("airflow-e2e")
    port = free_port()
    saved = dict(os.environ)  # restored at the end: these settings must not leak into later test modules
    os.environ.update(
        {
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "1200",
            # weekly, ending on the backfill's last date: the run that unpausing with catchup off would schedule is the
            # backfill's own last date, so no extra scheduled run competes with the backfill
            "PIPELINE_SCHEDULE": "@weekly",
            "PIPELINE_END_DATE": DATES[-1],
        }
    )
    home, log = tmp / "pipeline", tmp / "standalone.log"
    proc = None
    try:
        proc, url = start(home, tmp / "airflow-home", port, log)  # `make airflow`'s code path
        env = dict(os.environ, AIRFLOW_HOME=str(tmp / "airflow-home"), AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"))
        airflow_bin = str(Path(sys.executable).with_name("airflow"))
        deadline = time.time() + 300
        while time.time() < deadline:  # through the REST API: an airflow CLI call per poll costs seconds of CPU
            try:
                if api(url, "/dags/verl_grpo_pipeline").get("dag_id") == "verl_grpo_pipeline":
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(3)
        else:
            pytest.fail("the DAG processor did not register verl_grpo_pipeline within 5 minutes")
        yield {"env": env, "bin": airflow_bin, "home": tmp, "db": tmp / "airflow-home" / "airflow.db", "url": url}
    finally:
        if proc is not None:
            stop(proc, home)
        os.environ.clear()
        os.environ.update(saved)


def _create_backfill_in_the_ui(url: str, shots: Path) -> None:
    """What a user does: Trigger -> Backfill, the date range in the date pickers, Smoke run on, Run Backfill."""
    import shutil

    from playwright.sync_api import expect, sync_playwright

    from tests.helpers.chromium import CHROMIUM_ARGS

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: apt-get install -y chromium (.ci/run does it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        page.goto(login_url(url))  # the link make airflow prints: one click logs the browser in
        page.wait_for_url(f"{url}/", timeout=60_000)
        page.goto(f"{url}/dags/verl_grpo_pipeline", wait_until="networkidle")
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_text("Backfill", exact=True).click()
        dialog.get_by_text("Run Backfill - verl_grpo_pipeline").wait_for()
        for i, day in enumerate((DATES[0], DATES[-1])):  # From, To
            dialog.locator("[data-testid=datetime-input]").nth(i).click()
            page.get_by_placeholder("YYYY/MM/DD").fill(day.replace("-", "/"))
            page.get_by_placeholder("HH:mm").fill("00:00")
            page.keyboard.press("Tab")
            dialog.get_by_text("Date Range").click()  # closes the picker, not the dialog
            expect(page.get_by_placeholder("YYYY/MM/DD")).to_have_count(0, timeout=15000)
        # Airflow 3.3's backfill form sends no parameters at all (dag_run_conf null: every run gets the DAG's
        # defaults) unless this box is ticked, even for dates with no run yet; the README says so too
        dialog.get_by_text("Override parameters on existing runs").click()
        dialog.get_by_role("button", name="Experiment").click()
        smoke = dialog.get_by_role("checkbox", name="Smoke run")
        dialog.get_by_text("Smoke run").click()
        expect(smoke).to_be_checked(timeout=15000)
        page.screenshot(path=str(shots / "backfill-form.png"), full_page=True)
        run = dialog.get_by_role("button", name="Run Backfill")
        assert run.is_enabled(), dialog.inner_text()[-2000:]
        run.click()
        expect(dialog).to_be_hidden(timeout=30000)  # the dialog closes once the backfill is created
        page.screenshot(path=str(shots / "backfill-created.png"), full_page=True)
        browser.close()


@pytest.mark.budget(900)  # 559 s in make test at a load average of 10
def test_a_backfill_created_in_the_ui_trains_on_the_dataset_versions_of_each_date(airflow):
    """The backfill is created in a real browser (Chromium via Playwright) from the Trigger dialog's Backfill
    option, as a user would; screenshots land in the test's directory (backfill-form.png, backfill-created.png)."""
    env, airflow_bin = airflow["env"], airflow["bin"]
    shots = airflow["home"] / "screenshots"
    shots.mkdir(exist_ok=True)
    _create_backfill_in_the_ui(airflow["url"], shots)
    subprocess.run(
        [airflow_bin, "dags", "unpause", "verl_grpo_pipeline"], env=env, check=True, capture_output=True, text=True
    )
    deadline = time.time() + 20 * 60  # under the test's own timeout (three times its budget)
    runs, every = [], []
    while time.time() < deadline:
        # the REST API the UI reads (an `airflow dags list-runs` per poll cost seconds of CPU each on two busy cores)
        try:
            every = api(airflow["url"], "/dags/verl_grpo_pipeline/dagRuns")["dag_runs"]
        except OSError:
            every = []
        runs = [r for r in every if r["run_type"] == "backfill"]
        if len(runs) == len(DATES) and all(r["state"] in ("success", "failed") for r in runs):
            break
        time.sleep(10)
    assert len(runs) == len(DATES), runs
    sent = [r["conf"] for r in runs]
    assert all(c.get("smoke") is True for c in sent), sent  # what the form sent
    others = [r["dag_run_id"] for r in every if r["run_type"] != "backfill"]
    assert not others, f"unexpected non-backfill runs: {others}"
    assert all(r["state"] == "success" for r in runs), (runs, (airflow["home"] / "standalone.log").read_text()[-4000:])
    runs.sort(key=lambda r: r["logical_date"])
    index = json.loads(
        (airflow["home"] / "pipeline" / "hf-cache" / "revision-index" / "openai--gsm8k.json").read_text()
    )
    v1, v2 = index[0]["commit"], index[1]["commit"]
    gsm8k = []
    for r in runs:
        (done,) = [d for d in xcom(airflow["db"], r["dag_run_id"], "upload_dataset") if d["dataset"] == "gsm8k"]
        gsm8k.append(done)
        assert done["revision"] == done["download"]["commit"]
        assert xcom(airflow["db"], r["dag_run_id"], "train")[0]["last_step"] == 1  # smoke: one step
    assert [d["revision"] for d in gsm8k] == [v1, v2]
    # each revision is processed and uploaded as a version of its own
    assert [d["preprocess"]["skipped"] for d in gsm8k] == [False, False]
    assert all(d["upload"]["uploaded"] > 0 for d in gsm8k) and gsm8k[1]["upload"]["uri"] != gsm8k[0]["upload"]["uri"]
