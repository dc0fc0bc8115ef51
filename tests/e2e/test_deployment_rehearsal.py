"""The deployment rehearsal: the whole DAG on a distributed executor whose workers share nothing but the store, the
metadata database and the broker, as tasks do on the KubernetesExecutor the Helm values deploy (every task a pod whose
disk is deleted when it ends) and on a CeleryExecutor spread over hosts.

Real parts: Airflow's CeleryExecutor (apache-airflow-providers-celery), Debian's ``redis-server`` as its broker (started
here, loopback only), PostgreSQL 15 as the metadata database, Airflow's scheduler, DAG processor, triggerer and API
server (``scripts/airflow_components.py``, as ``make airflow`` runs them), and two Celery workers, each a host of its
own: its own mount namespace with an empty tmpfs over the pipeline's home (work directory, local mirror, caches) and
over Airflow's task-log folder, and its own host name (UTS namespace). The store is the OSS test server (an OSS-dialect
layer over moto: Alibaba OSS cannot be reached from here), reached through the Airflow connection only. Training runs
on a local Ray cluster the test starts, standing for the KubeRay cluster: the job reads its inputs from the store and
commits the run directory there itself. The Hugging Face Hub is the offline cache, shared as the Hub is.

What it shows (issue 45): the run succeeds; the mapped datasets' tasks land on both workers; the first ``preprocess``
to run on worker A (whose ``download`` ran there too) is killed with its host (SIGKILL of every process of A's
namespace, and its disk gone), then retried on worker B, and succeeds. Task logs go to the bucket (the Alibaba
provider's OSS remote logging, as the Helm values configure it): the retried task's log is read through the API server
after both workers are gone. On the code before the handoffs went through the store, this run failed: the retried
``preprocess`` found no snapshot on B's disk, and a ``train`` on B handed the job paths on B's disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.airflow_api import api
from tests.helpers.storage_servers import OSS_KEY_ID, OSS_REGION, OSS_SECRET

ROOT = Path(__file__).resolve().parents[2]
DAG = "verl_grpo_pipeline"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs_root(reason="each worker is a host of its own: unshare -m -u and a tmpfs"),
]


def _free_port() -> int:
    from scripts.local_profile import _free_port

    return _free_port()


@pytest.fixture
def redis_url(tmp_path):
    """Debian's redis-server on a free loopback port, nothing persisted."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed: bash scripts/system_packages.sh test"
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != (
            "PONG"
        ):
            assert time.time() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.2)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


class Worker:
    """A Celery worker on a host of its own: a new mount and UTS namespace, an empty tmpfs over each private path."""

    def __init__(self, name: str, env: dict, private: list[Path], log: Path):
        self.name, self.env, self.private, self.log = name, env, private, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        airflow = str(Path(sys.executable).with_name("airflow"))
        mounts = " && ".join(f"mount -t tmpfs -o size=4g tmpfs {p}" for p in self.private)
        script = (
            f"mount --make-rprivate / && {mounts} && hostname {self.name} && "
            f"exec {airflow} celery worker --concurrency 1 --celery-hostname {self.name}@%h --without-mingle "
            "--without-gossip --skip-serve-logs"
        )
        for p in self.private:
            p.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                ["unshare", "-m", "-u", "sh", "-c", script],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """The host dies: every process in its session, at once (its tmpfs goes with its namespace)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _task_instances(url: str, run_id: str) -> list[dict]:
    return api(url, f"/dags/{DAG}/dagRuns/{run_id}/taskInstances?limit=200")["task_instances"]


def _tries(url: str, run_id: str, task_id: str, map_index: int) -> list[dict]:
    path = f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries"
    if map_index < 0:
        path = f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/tries"
    return api(url, path)["task_instances"]


@pytest.mark.budget(900)
def test_the_dag_runs_on_workers_that_share_nothing_but_the_store(tmp_path, postgres, redis_url, oss_server):
    from pipeline_steps.local import offline_hub, ray_cluster
    from scripts import airflow_local
    from scripts.airflow_local import airflow_env, stop_components

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    hub = tmp_path / "hub"  # the Hub: shared by every host, as the Hub is
    port = _free_port()
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = postgres  # prepare() migrates PostgreSQL, not SQLite
    try:
        env = airflow_env(home, airflow_home, port)
    finally:
        os.environ.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    offline_hub.build_cache(offline_hub.FIXTURES, hub)
    prefix = f"rehearsal-{uuid.uuid4().hex[:8]}"
    store = f"oss://test-bucket/{prefix}"
    ray_dir = Path(f"/tmp/rr-{uuid.uuid4().hex[:6]}")  # short: Ray puts Unix sockets below it
    ray_env = {
        k: v
        for k, v in env.items()
        if not k.startswith(("OSS_", "GOOGLE_", "GCS_", "STORAGE_EMULATOR", "AIRFLOW_CONN_"))
    }
    ray_env.update(HF_HUB_CACHE=str(hub), PIPELINE_HOME=str(tmp_path / "ray-host"))
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(ray_env)
    os.environ.pop("RAY_ADDRESS", None)
    try:  # the training cluster: a host of its own (its own home), reached by address and token like KubeRay's
        ray_address = ray_cluster.ensure_cluster(
            port=_free_port(), dashboard_port=_free_port(), num_cpus=2, temp_dir=ray_dir, timeout=240
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    env.update(
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres,
            "AIRFLOW__CELERY__BROKER_URL": redis_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + postgres,
            "AIRFLOW__CORE__PARALLELISM": "8",
            # a task whose worker died is failed (and retried) after 60 s without a heartbeat, not 300 s
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
            "PIPELINE_SCHEDULE": "none",
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "socket.gethostname",  # the worker's own host name (UTS namespace)
            "PIPELINE_STORE_URI": store,
            # one connection for the store and the task logs, in the Alibaba provider's shape (auth_type AK)
            "AIRFLOW_CONN_PIPELINE_STORE": json.dumps(
                {
                    "conn_type": "alibaba_cloud",
                    "extra": {
                        "auth_type": "AK",
                        "access_key_id": OSS_KEY_ID,
                        "access_key_secret": OSS_SECRET,
                        "region": OSS_REGION,
                        "endpoint": oss_server.endpoint,
                        "path_style": "true",
                    },
                }
            ),
            "AIRFLOW__LOGGING__REMOTE_LOGGING": "True",
            "AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER": f"oss://test-bucket/{prefix}/airflow-logs",
            "AIRFLOW__LOGGING__REMOTE_LOG_CONN_ID": "pipeline_store",
            "HF_HUB_CACHE": str(hub),
            "RAY_ADDRESS": ray_address,
            "RAY_AUTH_TOKEN": (ray_dir / "auth_token").read_text().strip(),
        }
    )
    for k in list(env):  # the store's credentials reach the tasks through the connection only
        if k.startswith(("OSS_", "GOOGLE_", "GCS_", "STORAGE_EMULATOR")):
            del env[k]
    private = [home, airflow_home / "logs"]
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = {n: Worker(n, env, private, logs / f"{n}.log") for n in ("worker-a", "worker-b")}
    components = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "airflow_components.py")],
        env=env,
        stdout=open(logs / "components.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    airflow_local._HOMES[url] = airflow_home  # where the API helper finds the admin's password
    started = time.time()
    try:
        deadline = time.time() + 300
        while True:
            try:
                api(url, f"/dags/{DAG}")
                break
            except OSError:
                assert time.time() < deadline, f"Airflow did not come up; see {logs / 'components.log'}"
                time.sleep(3)
        api(url, f"/dags/{DAG}", "PATCH", {"is_paused": False})
        workers["worker-a"].start()  # A alone first: the first task surely lands on it
        run = api(
            url,
            f"/dags/{DAG}/dagRuns",
            "POST",
            {
                "logical_date": None,
                "conf": {
                    "experiment": "local_tiny",
                    "smoke": True,
                    "verl_overrides": ["trainer.logger=[console,file]"],
                },
            },
        )
        run_id = run["dag_run_id"]
        # the first preprocess running on A (its snapshot downloaded there): A dies with it (every process, its
        # disk), then B starts (a fresh host) and retries it
        deadline = time.time() + 600
        victim = None
        while victim is None:
            assert time.time() < deadline, "no preprocess task started on worker-a"
            victim = next(
                (
                    t
                    for t in _task_instances(url, run_id)
                    if t["task_id"] == "preprocess" and t["state"] == "running" and t["hostname"] == "worker-a"
                ),
                None,
            )
            time.sleep(0.3)
        workers["worker-a"].kill()
        killed = (victim["task_id"], victim["map_index"])
        workers["worker-b"].start()  # B alone: the killed task is retried on the other host
        deadline = time.time() + 600
        while not any(t["state"] == "success" for t in _tries(url, run_id, *killed)):
            assert time.time() < deadline, f"{killed} was not retried to success: {_tries(url, run_id, *killed)}"
            time.sleep(3)
        workers["worker-a"] = Worker("worker-a", env, private, logs / "worker-a.2.log")
        workers["worker-a"].start()  # A comes back as a new machine: an empty disk
        deadline = time.time() + 1500
        while (state := api(url, f"/dags/{DAG}/dagRuns/{run_id}")["state"]) not in ("success", "failed"):
            assert time.time() < deadline, "the run did not finish"
            time.sleep(5)
        tis = _task_instances(url, run_id)
        table = sorted((t["task_id"], t["map_index"], t["state"], t["hostname"], t["try_number"]) for t in tis)
        print("task, map index, state, host, try:")
        for row in table:
            print("  ", *row)
        print(f"killed on worker-a: {killed}; wall time {time.time() - started:.0f} s")
        assert state == "success", f"the run failed: {table}; logs in {logs}"
        tries = _tries(url, run_id, *killed)
        print("tries of the killed task:", [(t["try_number"], t["state"], t["hostname"]) for t in tries])
        assert tries[0]["hostname"] == "worker-a" and tries[0]["state"] != "success", tries
        assert tries[-1]["state"] == "success" and tries[-1]["hostname"] == "worker-b", tries
        mapped = {t["hostname"] for t in tis if t["task_id"] in ("download", "preprocess", "upload_dataset")}
        assert mapped == {"worker-a", "worker-b"}, f"the mapped dataset tasks all ran on {mapped}"
        for w in workers.values():  # every worker gone, their disks with them: the log is in the bucket only
            w.stop()
        task_id, map_index = killed
        log = api(
            url,
            f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{tries[-1]['try_number']}"
            f"?map_index={map_index}&full_content=true",
        )
        text = json.dumps(log["content"])
        print("the retried task's log, read after its worker stopped:", text[:600])
        assert "running: python -m pipeline_steps preprocess" in text, text[:2000]
    finally:
        for w in workers.values():
            w.stop()
        stop_components(components)
        ray_cluster.shutdown_cluster(temp_dir=ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)
