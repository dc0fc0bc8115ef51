"""The local Ray backend: a local Ray cluster and Ray's ``JobSubmissionClient``.

* :func:`ensure_cluster` returns the dashboard address of the cluster to use:
  ``address`` or ``$RAY_ADDRESS`` when configured, else the cluster this module
  started before (its state file), else a running cluster on the dashboard port,
  else it starts ``ray start --head --block`` on 127.0.0.1 in a session of its
  own (so :func:`shutdown_cluster` can stop exactly that cluster, workers and all:
  pipeline_steps/local/sessions.py; ``ray stop`` would stop every Ray on the machine).
* :func:`submit_or_attach` submits a job under a caller-chosen submission id,
  or attaches when that id already exists and is live or succeeded: a retried
  Airflow worker never submits twice. The entrypoint argv is joined with
  ``shlex.quote``, so untrusted values cannot break out of their argument.

Token authentication (Ray's ``RAY_AUTH_MODE=token``): a started cluster requires a token on every request (jobs API,
dashboard, GCS, the Ray client); :func:`ensure_cluster` generates one per cluster directory (``auth_token``, mode
0600, never logged) and starts the cluster with ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN_PATH`` (its processes and the jobs'
drivers inherit them). This module's clients send the token as an explicit header: this process's environment is
left alone (Ray's own loader would cache one token per process). Every server of the cluster listens on 127.0.0.1.

Ports (all on 127.0.0.1) come from arguments, else ``PIPELINE_RAY_PORT`` (GCS,
default 6379), ``PIPELINE_RAY_DASHBOARD_PORT`` (default 8265); the Ray client and
dashboard-agent ports are picked free so two clusters on one machine do not
collide. Cluster files go under ``PIPELINE_RAY_TEMP_DIR`` (default
``/tmp/ray_pipeline``; kept short because Ray puts Unix sockets there).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline_steps import settings
from pipeline_steps.local.sessions import pid_alive, stop_session

log = logging.getLogger(__name__)

LIVE = {"PENDING", "RUNNING"}
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
STATE_FILE = "pipeline_ray_cluster.json"
# seconds Ray's daemons get between SIGTERM and SIGKILL at shutdown (a stopped job's driver gets 3 s from Ray)
RAY_TERM_GRACE_S = 5.0


class JobNotFoundError(LookupError):
    """No Ray job has this submission id."""


class JobAlreadyFinishedError(RuntimeError):
    """The submission id belongs to a job that failed or was stopped; a new attempt needs a new id."""


def _temp_dir(temp_dir=None) -> Path:
    return Path(temp_dir or settings.get(settings.RAY_TEMP_DIR))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TOKENS: dict[str, Path] = {}  # dashboard address -> token file, for the clusters ensure_cluster found or started


def _auth_headers(address: str | None = None, token_path=None) -> dict[str, str]:
    """The Authorization header for Ray's token mode: the token in ``token_path``, else that of the cluster at
    ``address`` that :func:`ensure_cluster` found or started, else ``$RAY_AUTH_TOKEN``, else the file
    ``$RAY_AUTH_TOKEN_PATH``, else the default local cluster's (a triggerer that never started it finds it through
    ``$PIPELINE_RAY_TEMP_DIR``); none when there is no token."""
    path = token_path or _TOKENS.get((address or "").rstrip("/"))
    if not path and os.environ.get("RAY_AUTH_TOKEN"):
        return {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"}
    candidates = (path,) if path else (os.environ.get("RAY_AUTH_TOKEN_PATH"), _temp_dir() / "auth_token")
    for candidate in filter(None, candidates):  # an unset $RAY_AUTH_TOKEN_PATH must not end the search
        try:
            return {"Authorization": f"Bearer {Path(candidate).read_text().strip()}"}
        except OSError:
            continue
    return {}


def _get(url: str, timeout: float, address: str):
    request = urllib.request.Request(url, headers=_auth_headers(address))
    return urllib.request.urlopen(request, timeout=timeout)


def _responds(address: str, timeout: float = 2.0) -> bool:
    """True when a Ray dashboard with the jobs API answers at ``address`` (and accepts our token, if it wants one)."""
    try:
        with _get(address.rstrip("/") + "/api/version", timeout, address) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def ensure_token(directory: Path) -> Path:
    """The local cluster's token file, ``directory/auth_token``, created (mode 0600) when missing. Never logged."""
    path = directory / "auth_token"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # first writer wins: a concurrent starter never replaces a token already in use
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path


def _read_state(temp_dir) -> dict | None:
    p = _temp_dir(temp_dir) / STATE_FILE
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, ValueError):
        return None


def ensure_cluster(
    address: str | None = None,
    *,
    port: int | None = None,
    dashboard_port: int | None = None,
    num_cpus: int | None = None,
    temp_dir: str | os.PathLike | None = None,
    timeout: float = 180,
) -> str:
    """Return the dashboard address (``http://host:port``) of a usable Ray cluster, starting one if needed.

    :param address: a configured cluster (dashboard URL); else ``$RAY_ADDRESS``; else local.
    :param port: GCS port of a started head (default ``$PIPELINE_RAY_PORT`` or 6379).
    :param dashboard_port: dashboard/jobs API port (default ``$PIPELINE_RAY_DASHBOARD_PORT`` or 8265).
    :param num_cpus: CPUs the head advertises (default: Ray's detection).
    :param temp_dir: Ray's temp dir and our state file (default ``$PIPELINE_RAY_TEMP_DIR`` or /tmp/ray_pipeline).
    :param timeout: seconds to wait for a started head's jobs API.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        if not address.startswith(("http://", "https://")):
            address = "http://" + address
        return address
    tmp = _temp_dir(temp_dir).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    token = ensure_token(tmp)
    state = _read_state(temp_dir)
    if state:
        _TOKENS[state["address"]] = token
    if state and pid_alive(state["pid"]) and _responds(state["address"]):
        return state["address"]
    dashboard_port = int(dashboard_port or settings.get_int(settings.RAY_DASHBOARD_PORT))
    url = f"http://127.0.0.1:{dashboard_port}"
    _TOKENS[url] = token
    if _responds(url):
        log.info("reusing the Ray cluster whose dashboard answers at %s", url)
        return url
    port = int(port or settings.get_int(settings.RAY_PORT))
    ray_exe = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_exe) if ray_exe.exists() else "ray",
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={int(num_cpus)}")
    log_path = tmp / "ray_start.log"
    # Ray on Linux replaces --node-ip-address=127.0.0.1 by the machine's routable address (and its servers follow
    # it); its single-machine mode (the Windows/macOS default) keeps the loopback address. One node only, here.
    # Token authentication: every process of the cluster (and each job's driver) inherits the mode and the file.
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # a Ray client's own server process gets 30 s to start by default: under load a fresh `import ray` takes longer
    env.setdefault("RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S", "120")
    env.pop("RAY_AUTH_TOKEN", None)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    state = {"pid": proc.pid, "pgid": proc.pid, "address": url, "temp_dir": str(tmp), "log": str(log_path)}
    (tmp / STATE_FILE).write_text(json.dumps(state))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            (tmp / STATE_FILE).unlink(missing_ok=True)
            tail = log_path.read_text(errors="replace")[-600:].strip().splitlines()
            raise RuntimeError(f"ray start exited with {proc.returncode}: {tail[-1] if tail else ''} (see {log_path})")
        if _responds(url) and _jobs_api_ready(url):
            log.info("started a local Ray cluster at %s (pid %d)", url, proc.pid)
            return url
        time.sleep(1)
    shutdown_cluster(temp_dir=tmp)
    raise TimeoutError(f"the local Ray cluster did not answer at {url} within {timeout:.0f}s (see {log_path})")


def _jobs_api_ready(url: str) -> bool:
    try:
        with _get(url + "/api/jobs/", 5, url) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _client(address: str, token_path=None):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=_auth_headers(address, token_path) or None)


def _info(client, submission_id: str):
    try:
        return client.get_job_info(submission_id)
    except RuntimeError as exc:
        if "status code 404" in str(exc) or "does not exist" in str(exc):
            return None
        raise


def _status_str(info) -> str:
    s = info.status
    return s.value if hasattr(s, "value") else str(s)


def submit_or_attach(
    address: str,
    submission_id: str,
    entrypoint_argv: list[str],
    env: dict | None = None,
    working_dir: str | None = None,
    agent_timeout: float = 300,
) -> str:
    """Submit ``entrypoint_argv`` as job ``submission_id``, or attach to the live/succeeded job of that id.

    :param address: dashboard address from :func:`ensure_cluster`.
    :param submission_id: deterministic id (for example from dag/run/task/try), so a retry finds the job.
    :param entrypoint_argv: the command as an argument list; every item is shell-quoted.
    :param env: environment variables for the job (visible in the dashboard: no secrets).
    :param working_dir: optional runtime_env working_dir (uploaded by Ray).
    :param agent_timeout: seconds to retry while a new head's job agent is not ready yet.
    :raises JobAlreadyFinishedError: the id names a FAILED or STOPPED job (a retry needs a new id).
    """
    client = _client(address)
    info = _info(client, submission_id)
    if info is None:
        runtime_env = {}
        if env:
            runtime_env["env_vars"] = {str(k): str(v) for k, v in env.items()}
        if working_dir:
            runtime_env["working_dir"] = str(working_dir)
        entrypoint = shlex.join(str(a) for a in entrypoint_argv)
        deadline = time.monotonic() + agent_timeout
        while True:
            try:
                client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env or None)
                log.info("submitted Ray job %s", submission_id)
                return submission_id
            except RuntimeError as exc:
                info = _info(client, submission_id)  # another submitter won the race
                if info is not None:
                    break
                # a freshly started head answers before its dashboard agent can take jobs
                if "try again later" in str(exc) and time.monotonic() < deadline:
                    time.sleep(2)
                    continue
                raise
    status = _status_str(info)
    if status in LIVE or status == "SUCCEEDED":
        log.info("attached to Ray job %s (%s)", submission_id, status)
        return submission_id
    raise JobAlreadyFinishedError(
        f"Ray job {submission_id} already ended {status}: {info.message or ''}; "
        "a new attempt needs a new submission id (it resumes from the checkpoint directory)"
    )


def status(address: str, submission_id: str) -> str:
    """``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED``. :raises JobNotFoundError:"""
    info = _info(_client(address), submission_id)
    if info is None:
        raise JobNotFoundError(f"no Ray job with submission id {submission_id} at {address}")
    return _status_str(info)


def info(address: str, submission_id: str) -> dict:
    """The job's details (status, message, start/end times) as a dict. :raises JobNotFoundError:"""
    details = _info(_client(address), submission_id)
    if details is None:
        raise JobNotFoundError(f"no Ray job with submission id {submission_id} at {address}")
    d = details.dict() if hasattr(details, "dict") else dict(details.__dict__)
    d["status"] = _status_str(details)
    return d


def logs(address: str, submission_id: str) -> str:
    """The job driver's whole log so far."""
    try:
        return _client(address).get_job_logs(submission_id)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            raise JobNotFoundError(f"no Ray job with submission id {submission_id} at {address}") from None
        raise


def stop(address: str, submission_id: str) -> bool:
    """Ask Ray to stop the job (SIGTERM, then SIGKILL); True if it was running."""
    try:
        return bool(_client(address).stop_job(submission_id))
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            raise JobNotFoundError(f"no Ray job with submission id {submission_id} at {address}") from None
        raise


def wait(address: str, submission_id: str, timeout: float, poll: float = 1.0) -> str:
    """Poll :func:`status` until the job ends; returns the final status. :raises TimeoutError:"""
    deadline = time.monotonic() + timeout
    while True:
        s = status(address, submission_id)
        if s in TERMINAL:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray job {submission_id} still {s} after {timeout:.0f}s")
        time.sleep(poll)


def shutdown_cluster(temp_dir: str | os.PathLike | None = None, timeout: float = 30) -> bool:
    """Stop the cluster :func:`ensure_cluster` started (its jobs first); False if it started none."""
    state = _read_state(temp_dir)
    if not state:
        return False
    pid, sid = int(state["pid"]), int(state["pgid"])
    if pid_alive(pid):
        try:  # stop running jobs first: Ray ends their drivers gracefully
            client = _client(state["address"], _temp_dir(state.get("temp_dir")) / "auth_token")
            for job in client.list_jobs():
                if _status_str(job) in LIVE and job.submission_id:
                    client.stop_job(job.submission_id)
        except Exception as exc:  # the cluster may already be half down
            log.warning("could not stop jobs before shutdown: %s", exc)
    # also when the leader is gone: its session's workers may outlive it (and its pid, still their session id, is
    # not reused while they run). The jobs were stopped above; what is left is Ray's own daemons, whose SIGTERM
    # handling drains for 10-20 s (measured: the raylet, the GCS and the autoscaler monitor) and keeps nothing a
    # local run needs (the GCS holds no state on disk here), so they get RAY_TERM_GRACE_S, then SIGKILL.
    stop_session(pid, sid, timeout, grace=RAY_TERM_GRACE_S)
    (_temp_dir(state.get("temp_dir")) / STATE_FILE).unlink(missing_ok=True)
    log.info("stopped the local Ray cluster at %s", state["address"])
    return True


def job_argv(python: str | None = None, *step_argv: str) -> list[str]:
    """``[python, -m, pipeline_steps, *step_argv]`` with this interpreter by default (the job runs on this host)."""
    return [python or sys.executable, "-m", "pipeline_steps", *step_argv]
