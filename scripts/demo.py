"""`make demo`: run the whole DAG once on the bundled local profile and say where everything went.

Local profile: SQLite Airflow metadata in ./.airflow, a local object store (file://) in ./.demo/store, an offline
Hugging Face cache built from the shipped fixtures, a local Ray cluster, and the tiny locally built model. The run
goes through Airflow's own scheduler, DAG processor, triggerer and API server, those `make airflow` starts (see
``_run``), so the UI shows it with every task's log afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path

from pipeline_steps import library_env, settings
from scripts.local_profile import ROOT, _free_port, newest_run, stop_services, task_states, xcom


def learning_summary(trained: dict) -> str:
    """Mean reward (verl's ``critic/score/mean``) of the first and the last tenth of the training steps."""
    from pipeline_steps import metrics_log
    from pipeline_steps.uris import strip_file_scheme

    path = Path(strip_file_scheme(trained.get("metrics_uri") or ""))
    rows = [r for r in metrics_log.read(path).rows if "critic/score/mean" in r["data"]] if path.is_file() else []
    if not rows:
        return f"training: no step metrics in {path}"
    k = max(len(rows) // 10, 1)
    first = sum(r["data"]["critic/score/mean"] for r in rows[:k]) / k
    last = sum(r["data"]["critic/score/mean"] for r in rows[-k:]) / k
    return (
        f"training: {len(rows)} GRPO steps; mean reward of steps {rows[0]['step']}-{rows[k - 1]['step']}: {first:.3f}, "
        f"of steps {rows[-k]['step']}-{rows[-1]['step']}: {last:.3f} ({last - first:+.3f})"
    )


def eval_summary(results: dict, base: dict) -> list[str]:
    """Held-out figures against the untuned baselines: the base model and the best constant answer."""
    from pipeline_steps.evaluation.metrics import figures_of

    f, b = figures_of(results) or {}, figures_of(base) or {}
    k, modal = results["overall"]["k"], f.get("modal_ground_truth")

    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    return [
        f"held-out avg@{k} ({results['overall']['problems']} problems): model {pct(results['overall']['avg@k'])}, "
        f"base {pct(base['overall']['avg@k'])}, "
        f"best constant answer ({modal!r} every time) {pct(f.get('best_constant'))}",
        f"avg@{k} on the {f.get('non_modal_problems')} problems whose answer is not {modal!r}: "
        f"model {pct(f.get('non_modal_avg@k'))}, base {pct(b.get('non_modal_avg@k'))}",
        f"distinct majority answers: model {f.get('majority_distinct')}, base {b.get('majority_distinct')}, "
        f"ground truth {f.get('ground_truth_distinct')}",
    ]


def show_run(db: Path) -> None:
    """The newest run, short: failed tasks, learning, held-out evaluation, promotion, where the report is."""
    run_id = newest_run(db)
    if not run_id:
        return
    bad = {t: s for t, s in task_states(db, run_id).items() if s not in ("success", "skipped")}
    print(f"\nrun {run_id}" + (f": tasks not successful: {bad}" if bad else ""))
    for t in xcom(db, run_id, "train"):
        print(learning_summary(t))
        if (t.get("mlflow") or {}).get("url"):
            print(f"MLflow run (web UI): {t['mlflow']['url']}")
    for e in xcom(db, run_id, "evaluate"):
        out = Path(e["evaluate"]["output"])
        try:
            results = json.loads((out / "results.json").read_text())
            base = json.loads((out / "base_results.json").read_text())
        except (OSError, ValueError) as exc:
            print(f"evaluation: unreadable ({exc})")
            continue
        print("\n".join(eval_summary(results, base)) + f"  (table: {out / 'results.md'})")
    for x in xcom(db, run_id, "export"):
        ex = x["export"]
        print(f"promoted: {ex['promoted']} ({ex.get('reason')})\nexported model: {ex['uri']}")
    for r in xcom(db, run_id, "report"):
        print(f"run report: {r['report']['report']}")


class Stop(BaseException):
    """Raised by the signal handler: SIGTERM, SIGINT or SIGHUP."""


def _on_signal(signum, _frame):
    raise Stop(signal.Signals(signum).name)


def _ignore_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)


def main() -> int:
    # a container stop (SIGTERM), Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop everything the demo started
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    home = settings.home()
    try:
        return _run(home)
    except Stop:
        return 130
    finally:
        _ignore_signals()
        ray, mlflow = stop_services(home)  # the demo started them; leave nothing running
        if ray:
            print("stopped the local Ray cluster the demo started")
        if mlflow:  # the runs stay in its SQLite store for the next start
            print(f"stopped the MLflow server the demo started (runs kept in {home / 'mlflow'})")


RUN_DEADLINE = 3600  # seconds the demo's run may take (about 5 minutes on two cores)
TERMINAL = ("success", "failed")


def _run(home: Path) -> int:
    """The demo's run goes through Airflow's own components, those ``make airflow`` starts (scheduler, DAG processor,
    triggerer, API server; scripts/airflow_local.py), in the same homes: each task runs as Airflow runs it and
    writes its log where the UI reads it, so ``make airflow`` afterwards shows the run with every task's log. The
    components stop once the run has ended (no deferred task or trigger is left behind)."""
    from pipeline_steps.local import mlflow_server
    from scripts import airflow_local

    started = time.monotonic()
    airflow_home = Path(os.environ.get("AIRFLOW_HOME") or ROOT / ".airflow")
    home.mkdir(parents=True, exist_ok=True)
    # local_arithmetic: the tiny model learns the synthetic task (its reward rises; on the held-out split it beats the
    # base model and the best constant answer); the other datasets are prepared to show their preprocessors
    conf = {"experiment": "local_arithmetic", "backend": "local", "prepare_datasets": ["gsm8k", "dapo_math"]}
    logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    log = home / "airflow.log"
    # the local profile's MLflow tracking server (SQLite under PIPELINE_HOME/mlflow); the DAG's tasks log to it
    os.environ[library_env.MLFLOW_TRACKING_URI] = mlflow_server.ensure_server(mlflow_server.server_dir(home / "mlflow"))
    print(f"MLflow UI and tracking server: {os.environ['MLFLOW_TRACKING_URI']}  (store {home / 'mlflow'})", flush=True)
    # only the demo's run: no scheduled run starts while the DAG is unpaused for it (`make airflow` parses the DAG
    # again with its own schedule)
    os.environ[settings.SCHEDULE] = "none"
    print(
        f"starting Airflow's scheduler, DAG processor, triggerer and API server (AIRFLOW_HOME={airflow_home}; "
        f"their log: {log}) ...",
        flush=True,
    )
    paused_here = _pause_before_start(airflow_home / "airflow.db")
    proc, url = airflow_local.start(home, airflow_home, _free_port(), log)
    run_id, state, was_paused = None, None, None
    try:
        dag = "/dags/verl_grpo_pipeline"
        deadline = time.monotonic() + airflow_local.START_TIMEOUT_S
        while was_paused is None:  # the DAG processor parses the DAG files first
            try:
                was_paused = airflow_local.api(url, dag)["is_paused"]
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Airflow did not parse verl_grpo_pipeline within {airflow_local.START_TIMEOUT_S // 60} "
                        f"minutes; see {log}"
                    )
                time.sleep(2)
        if was_paused:
            airflow_local.api(url, dag, "PATCH", {"is_paused": False})
        was_paused = was_paused and not paused_here
        run = airflow_local.api(url, f"{dag}/dagRuns", "POST", {"logical_date": logical, "conf": conf})
        run_id = run["dag_run_id"]
        print(f"running verl_grpo_pipeline on the local profile: run {run_id}", flush=True)
        state = _wait(url, f"{dag}/dagRuns/{urllib.parse.quote(run_id, safe='')}", started + RUN_DEADLINE)
    except Stop as sig:
        print(f"{sig}: stopping ...", flush=True)
        _ignore_signals()
        raise
    finally:
        if run_id and state not in TERMINAL:  # stopped or out of time: the run is over, not left to resume
            _end_run(url, run_id)
        if was_paused:
            _quietly(airflow_local.api, url, "/dags/verl_grpo_pipeline", "PATCH", {"is_paused": True})
        airflow_local.stop_components(proc)
    rc = 0 if state == "success" else 1
    show_run(airflow_home / "airflow.db")
    print(f"outputs: {home / 'store'} (datasets, models, runs, models/exported); work dir {home / 'work'}")
    print(
        f"task logs: {airflow_home / 'logs'}; `make airflow` shows the run and each task's log in the UI\n"
        f"\nDAG run {'succeeded' if rc == 0 else f'FAILED (state {state}): see the task logs'}"
    )
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return rc


def _wait(url: str, run_path: str, deadline: float) -> str | None:
    """Wait for the run to end; print each task as it ends. The run's final state, or None past the deadline."""
    from scripts.airflow_local import api

    shown: set[tuple[str, int]] = set()
    while time.monotonic() < deadline:
        try:
            state = api(url, run_path)["state"]
            tis = api(url, f"{run_path}/taskInstances?limit=100")["task_instances"]
        except OSError as exc:  # the API server is busy or restarting: ask again
            print(f"  (Airflow's API: {exc}; asking again)", flush=True)
            time.sleep(5)
            continue
        for ti in sorted(tis, key=lambda t: t.get("end_date") or ""):
            key = (ti["task_id"], ti["map_index"])
            if ti["state"] in ("success", "failed", "skipped", "upstream_failed") and key not in shown:
                shown.add(key)
                mapped = f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""
                print(f"  {ti['task_id']}{mapped}: {ti['state']}", flush=True)
        if state in TERMINAL:
            return state
        time.sleep(5)  # two small API calls a poll: little beside the tasks on two cores
    print(f"the run did not end within {RUN_DEADLINE} s", flush=True)
    return None


def _pause_before_start(db: Path) -> bool:
    """Pause the DAG if an earlier ``make airflow`` left it unpaused; whether it did. Until the DAG processor parses
    the file again with no schedule, the scheduler goes by the stored schedule, and an unpaused DAG whose interval
    has passed would start a scheduled run that the demo's run then waits behind (one active run at a time)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            row = c.execute("SELECT is_paused FROM dag WHERE dag_id='verl_grpo_pipeline'").fetchone()
    except sqlite3.Error:  # no database or no DAG yet: a new DAG is paused at creation
        return False
    if not row or row[0]:
        return False
    airflow = str(Path(sys.executable).with_name("airflow"))
    env = dict(os.environ, AIRFLOW_HOME=str(db.parent))
    subprocess.run([airflow, "dags", "pause", "verl_grpo_pipeline"], env=env, check=True, capture_output=True)
    return True


def _end_run(url: str, run_id: str) -> None:
    """Mark an unfinished run failed, so the next start of Airflow does not pick it up half-done."""
    from scripts.airflow_local import api

    path = f"/dags/verl_grpo_pipeline/dagRuns/{urllib.parse.quote(run_id, safe='')}"
    if _quietly(api, url, path, "PATCH", {"state": "failed"}) is not None:
        print(f"marked run {run_id} failed", flush=True)


def _quietly(fn, *args):
    try:
        return fn(*args)
    except OSError as exc:
        print(f"  (Airflow's API: {exc})", flush=True)
        return None


if __name__ == "__main__":
    raise SystemExit(main())
