"""`make demo`: run the whole DAG once on the bundled local profile and say where everything went.

Local profile: SQLite Airflow metadata in ./.airflow, a local object store (file://) in ./.demo/store, an offline
Hugging Face cache built from the shipped fixtures, a local Ray cluster, and the tiny locally built model.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pipeline_steps import settings

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_temp_dir(home: Path) -> Path:
    """The local Ray cluster's directory, per profile home (short: Ray puts Unix sockets below it)."""
    return Path("/tmp") / f"ray-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]}"


def stop_services(home: Path) -> tuple[bool, bool]:
    """Stop the local Ray cluster and MLflow server that runs on profile ``home`` started on demand; whether each
    was running."""
    from pipeline_steps.local import mlflow_server, ray_cluster

    return bool(ray_cluster.shutdown_cluster(ray_temp_dir(home))), bool(mlflow_server.shutdown_server(home / "mlflow"))


def local_profile_env(home: Path) -> dict[str, str]:
    """Environment for the embedded default; tests use the same function. The local Ray cluster gets free ports
    and its own directory, so it never collides with another cluster on the machine."""
    return {
        settings.RAY_TEMP_DIR: str(ray_temp_dir(home)),
        settings.RAY_PORT: str(_free_port()),
        settings.RAY_DASHBOARD_PORT: str(_free_port()),
        settings.HOME: str(home),
        settings.STORE_URI: f"file://{home / 'store'}",
        "HF_HUB_CACHE": str(home / "hf-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        # a local job's status is one HTTP call to the local Ray cluster: read it every 5 s, not every 30 s as a
        # cluster's (a smoke run's train, evaluate and export each waited up to 30 s after their job had ended)
        settings.POLL_SECONDS: "5",
    }


def prepare(home: Path, airflow_home: Path) -> dict[str, str]:
    from pipeline_steps.local import offline_hub as local_hub

    env = dict(os.environ, **local_profile_env(home), AIRFLOW_HOME=str(airflow_home))
    env["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), env.get("PATH", "")]
    )  # airflow standalone spawns `airflow ...`
    local_hub.build_cache(local_hub.FIXTURES, home / "hf-cache")
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        # --include-deferred: a deferred train task keeps holding its slots while its job runs (Airflow's default
        # frees them, and a second run's train would start on the same GPUs)
        [airflow, "pools", "set", "gpu", "8", "GPUs on the training cluster", "--include-deferred"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return env


def xcom(db: Path, run_id: str, task_id: str, key: str = "return_value") -> list:
    """XCom values of one task of one run, read from the SQLite metadata database."""
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT value FROM xcom WHERE run_id=? AND task_id=? AND key=? ORDER BY map_index", (run_id, task_id, key)
        ).fetchall()
    out = []
    for (v,) in rows:
        v = json.loads(v) if isinstance(v, (str, bytes)) else v
        out.append(json.loads(v) if isinstance(v, str) else v)
    return out


def run_state(db: Path) -> str | None:
    """The newest pipeline run's state (``success``, ``failed``, ...)."""
    with sqlite3.connect(db) as c:
        row = c.execute(
            "SELECT state FROM dag_run WHERE dag_id='verl_grpo_pipeline' ORDER BY id DESC LIMIT 1"
        ).fetchone()
    return row[0] if row else None


def newest_run(db: Path, dag_id: str = "verl_grpo_pipeline") -> str | None:
    with sqlite3.connect(db) as c:
        row = c.execute("SELECT run_id FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1", (dag_id,)).fetchone()
    return row[0] if row else None


def task_states(db: Path, run_id: str) -> dict[str, str]:
    """``{"task[map_index]": state}`` of one run (``[-1]`` for unmapped tasks)."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT task_id, map_index, state FROM task_instance WHERE run_id=?", (run_id,)).fetchall()
    return {f"{t}[{m}]": s for t, m, s in rows}


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


def _run(home: Path) -> int:
    from pipeline_steps.local import ray_cluster

    started = time.monotonic()
    airflow_home = Path(os.environ.get("AIRFLOW_HOME") or ROOT / ".airflow")
    env = prepare(home, airflow_home)
    # local_arithmetic: the tiny model learns the synthetic task (its reward rises; on the held-out split it beats the
    # base model and the best constant answer); the other datasets are prepared to show their preprocessors
    conf = {"experiment": "local_arithmetic", "backend": "local", "prepare_datasets": ["gsm8k", "dapo_math"]}
    logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    airflow = str(Path(sys.executable).with_name("airflow"))
    log = home / "dag-test.log"
    from pipeline_steps.local import mlflow_server

    # the local profile's MLflow tracking server (SQLite under PIPELINE_HOME/mlflow); the DAG's tasks log to it
    env["MLFLOW_TRACKING_URI"] = mlflow_server.ensure_server(mlflow_server.server_dir(home / "mlflow"))
    print(f"MLflow UI and tracking server: {env['MLFLOW_TRACKING_URI']}  (store {home / 'mlflow'})", flush=True)
    print(
        f"running verl_grpo_pipeline on the local profile (AIRFLOW_HOME={airflow_home}); Airflow's log: {log} ...",
        flush=True,
    )
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [airflow, "dags", "test", "verl_grpo_pipeline", logical, "--conf", json.dumps(conf)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole on a signal
        )
        try:
            rc = proc.wait()
        except Stop as sig:
            print(f"{sig}: stopping ...", flush=True)
            _ignore_signals()
            ray_cluster.stop_group(proc.pid, proc.pid, timeout=60)
            proc.wait()
            raise
    state = run_state(airflow_home / "airflow.db")
    if rc == 0 and state != "success":  # `airflow dags test` exits 0 even when a task failed
        rc = 1
    show_run(airflow_home / "airflow.db")
    print(f"outputs: {home / 'store'} (datasets, models, runs, models/exported); work dir {home / 'work'}")
    print(f"\nDAG run {'succeeded' if rc == 0 else f'FAILED (state {state}): see the task logs in {log}'}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
