"""What the local profile leaves open: the real services, started as `make airflow` and the operators start them, and
the kernel's socket tables (/proc/net/tcp, tcp6: what ``ss -ltnp`` reads) for what their processes listen on.

* the local Ray cluster (``ray start --head``): every socket of every process of its group on a loopback address;
  token authentication on: the jobs API, the GCS (a driver's ``ray.init``) and the Ray client refuse a caller without
  the token, and accept one with it (so the refusal is the token's doing, not a broken server); the token file is
  private (0600) and in no log;
* `make demo`: a closed terminal (SIGHUP) in the middle of its DAG run leaves none of its processes alive.

`make airflow` itself (nothing on a non-loopback address; SIGTERM stops everything) is checked on the Airflow that
tests/e2e/test_ui_trigger_form.py starts with it, after the form's tests: one Airflow fewer in `make test`.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import listening

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    from scripts.local_profile import _free_port

    return _free_port()


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["PIPELINE_RAY_TEMP_DIR"] = "/nonexistent"  # no fallback to a default cluster's token
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # as the cluster's own drivers: 127.0.0.1 stays 127.0.0.1
    return env


def _connect(target: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # the Ray client's own debug log says why a ray:// connection attempt failed (its error only says "timeout")
    code = (
        "import logging, ray, sys; log = logging.getLogger('ray.util.client'); log.setLevel(logging.DEBUG); "
        "log.addHandler(logging.StreamHandler()); "
        "ray.init(address=sys.argv[1]); print('CONNECTED', ray.cluster_resources()['CPU'])"
    )
    try:
        return subprocess.run(
            [sys.executable, "-c", code, target], env=env, capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired as exc:  # still retrying after three minutes: not connected
        return subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or "")


@pytest.fixture(scope="module")
def cluster():
    from pipeline_steps.local import ray_cluster

    temp_dir = tempfile.mkdtemp(prefix="rx", dir="/tmp")  # short: Ray puts Unix sockets here
    gcs_port = _free_port()
    address = ray_cluster.ensure_cluster(port=gcs_port, dashboard_port=_free_port(), num_cpus=1, temp_dir=temp_dir)
    state = ray_cluster._read_state(temp_dir)
    try:
        yield {"address": address, "temp_dir": Path(temp_dir), "pgid": state["pgid"], "gcs_port": gcs_port}
    finally:
        assert ray_cluster.shutdown_cluster(temp_dir=temp_dir)
        subprocess.run(["rm", "-rf", temp_dir], check=False)


def _client_port(pgid: int) -> int:
    for pid in listening.in_session(pgid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ray.util.client.server" in argv:
            return int(next(a for a in argv if a.startswith(b"--port=")).split(b"=")[1])
    raise AssertionError("no Ray client server process in the cluster's group")


def test_local_ray_listens_on_loopback_only(cluster):
    socks = listening.wait_listening(lambda: listening.in_session(cluster["pgid"]), _client_port(cluster["pgid"]))
    # the GCS, the dashboard and the Ray client server at least (raylet, agents and workers add more)
    ports = {a.rsplit(":", 1)[1] for a in socks}
    assert {str(cluster["gcs_port"]), cluster["address"].rsplit(":", 1)[1], str(_client_port(cluster["pgid"]))} <= ports
    assert listening.not_loopback(socks) == [], f"Ray listens beyond the loopback: {socks}"


def test_local_ray_refuses_callers_without_the_token(cluster):
    token_file = cluster["temp_dir"] / "auth_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    logs = [p for p in cluster["temp_dir"].rglob("*") if p.is_file() and p.name != "auth_token" and p.stat().st_size]
    assert logs and not [p for p in logs if token.encode() in p.read_bytes()], "the token is written to a log"

    # jobs API over HTTP: 401 without the token, 200 with it
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(cluster["address"] + "/api/jobs/", timeout=10)
    assert refused.value.code == 401
    authed = urllib.request.Request(cluster["address"] + "/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(authed, timeout=10).status == 200

    # a driver joining over the GCS: refused without the token or with a wrong one, accepted with it
    gcs = f"127.0.0.1:{cluster['gcs_port']}"
    _refused_then_accepted(gcs, cluster["temp_dir"] / "auth_token")


def _with_token(token_file: Path) -> dict[str, str]:
    return dict(_clean_env(), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))


def _refused(target: str, env: dict[str, str] | None = None, because: str = "") -> None:
    """Neither a caller without the token nor one with a wrong token connects (and the client said ``because``)."""
    env = env or _clean_env()
    no = _connect(target, env)
    assert "CONNECTED" not in no.stdout and no.returncode != 0, f"{target} accepted a caller without the token"
    assert because in no.stderr, no.stderr[-800:]
    bad = _connect(target, dict(env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64))
    assert "CONNECTED" not in bad.stdout and bad.returncode != 0, f"{target} accepted a wrong token"
    assert because in bad.stderr, bad.stderr[-800:]


def _refused_then_accepted(target: str, token_file: Path) -> None:
    # a refused driver retries for 20 s (one try a second); the reason it gives is the proof, 3 tries are enough
    _refused(target, dict(_clean_env(), RAY_gcs_server_port_wait_time_s="3"), because="InvalidAuthToken")
    ok = _connect(target, _with_token(token_file))
    assert "CONNECTED 1.0" in ok.stdout, ok.stderr[-800:]


def test_the_ray_client_refuses_callers_without_the_token(cluster):
    """The Ray client (ray://): a refused caller's error is only a connection timeout, so the refusals count only
    after a caller with the token got in, and only with the reason the client logs for each attempt ("Invalid or
    missing authentication token"). Its per-client server process often fails to start on a loaded machine
    ("Starting Ray client server failed" in make test at a load average of 9, with 120 s to start; it connects on a
    quiet one): then the test reports XFAIL with that reason instead of passing unproven."""
    client = f"ray://127.0.0.1:{_client_port(cluster['pgid'])}"
    for _ in range(3):
        ok = _connect(client, _with_token(cluster["temp_dir"] / "auth_token"))
        if "CONNECTED 1.0" in ok.stdout:
            break
    else:
        pytest.xfail(f"the Ray client with the token did not connect in 3 attempts: {ok.stderr[-300:]}")
    # a refused caller retries 3 times, waiting 5, 10 and 15 s by default: 30 s of idle each; the reason it logs is
    # the proof, so 2 s per attempt is enough
    fast = dict(_clean_env(), RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S="2", RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S="2")
    _refused(client, fast, because="Invalid or missing authentication token")


def test_a_process_that_never_started_the_cluster_finds_its_token(cluster):
    """The triggerer polling a deferred train, and a worker resuming after it, never call ensure_cluster: they find
    the cluster's token through $PIPELINE_RAY_TEMP_DIR, and without it are refused for the token, not otherwise."""
    code = "import sys; from pipeline_steps.local import ray_cluster as r; r.status(sys.argv[1], 'no-such-job')"

    def status(temp_dir: str) -> str:
        env = dict(_clean_env(), PIPELINE_RAY_TEMP_DIR=temp_dir)
        argv = [sys.executable, "-c", code, cluster["address"]]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT).stderr

    found = status(str(cluster["temp_dir"]))
    assert "JobNotFoundError" in found and "Authentication" not in found, found[-800:]
    assert "Missing authentication token" in status("/nonexistent")


def test_make_demo_stops_everything_on_sighup(tmp_path):
    """A closed terminal (SIGHUP) in the middle of `make demo`'s DAG run: nothing it started stays alive."""
    from pipeline_steps.local import mlflow_server

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow-home"
    env = dict(os.environ, PIPELINE_HOME=str(home), AIRFLOW_HOME=str(airflow_home))
    env.pop("MLFLOW_TRACKING_URI", None)
    out = tmp_path / "make-demo.out"
    make = listening.start_make("demo", env, out)
    try:
        listening.wait_for_output(make, out, "running verl_grpo_pipeline", 300)
        deadline = time.monotonic() + 120  # until `airflow dags test` has children of its own (tasks running)
        while time.monotonic() < deadline and len(listening.descendants(make.pid)) < 6:
            time.sleep(1)
        started = listening.descendants(make.pid)
        assert len(started) >= 5, started  # make, the demo, MLflow, `airflow dags test` and what it runs
        # GNU make passes SIGTERM on to its children but not SIGHUP: a closed terminal sends SIGHUP to the whole
        # foreground process group, so send it to the group
        os.killpg(make.pid, signal.SIGHUP)
        make.wait(timeout=120)
        deadline = time.monotonic() + 60
        while listening.alive(started) and time.monotonic() < deadline:
            time.sleep(1)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in listening.alive(started)}
        assert not left, f"alive after SIGHUP to make demo: {left}"
        assert "SIGHUP: stopping" in out.read_text()
    finally:
        try:
            os.killpg(make.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        from pipeline_steps.local import ray_cluster
        from scripts.local_profile import ray_temp_dir

        ray_cluster.shutdown_cluster(ray_temp_dir(home))
        mlflow_server.shutdown_server(home / "mlflow")
        make.wait(timeout=30)
