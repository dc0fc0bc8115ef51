"""Start and stop a local sandbox server (tests, benchmarks, the local profile), and the E2B settings to reach it."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline_steps.sandbox import KEY_ENV
from pipeline_steps.sandbox.cgroups import CgroupError, Cgroups, cgroup_paths

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSandboxServer:
    """``with LocalSandboxServer(state_dir) as srv: Sandbox.create(**srv.sdk_options())``.

    :param extra_env: added to the server's environment (tests put a secret there to check it stays outside).
    :param args: extra ``sandbox-server`` options, e.g. ``["--exec-timeout", "5"]``.
    """

    def __init__(self, state_dir, args=(), extra_env=None, hide=(), startup_timeout=60.0, port=None):
        self.state_dir = Path(state_dir)
        self.api_key = secrets.token_hex(16)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.hide = [str(h) for h in hide]
        self.extra_env = dict(extra_env or {})
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """Environment variables that point the E2B SDK (and our tools) at this server."""
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def sdk_options(self) -> dict[str, str]:
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    def start(self) -> "LocalSandboxServer":
        cmd = [sys.executable, "-m", "pipeline_steps", "sandbox-server", "--port", str(self.port)]
        cmd += ["--state-dir", str(self.state_dir), *self.args]
        for h in self.hide:
            cmd += ["--hide", h]
        env = {**os.environ, **self.extra_env, KEY_ENV: self.api_key}
        self.log = open(self.state_dir.parent / f"sandbox-server-{self.port}.log", "wb")
        # the cgroup the server places its sandboxes' cgroups under: ours, before it may move (cgroup v2) itself
        self._cgroup_paths = cgroup_paths()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sandbox server not ready after {self.startup_timeout:g} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            import psutil

            try:  # its sandboxes (each in a session of its own): swept below if the server does not get to them
                below = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                below = []
            self.proc.send_signal(signal.SIGTERM)  # the server kills its sandboxes on the way out
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            for child in below:
                try:
                    child.kill()  # psutil checks the pid was not reused
                except psutil.Error:
                    pass
        if self.proc:
            self.log.close()
            self._remove_orphans()
            # a server killed before its clean-up (SIGKILL after the 20 s above) leaves its sandboxes' tmpfs mounted
            from pipeline_steps.sandbox.pool import mounts_under

            for point in mounts_under(self.state_dir):
                subprocess.run(["umount", "-l", str(point)], capture_output=True)

    def _remove_orphans(self):
        """The sandboxes of a server that died or was killed before its clean-up, through their cgroups: a frozen
        warm sandbox ignores SIGKILL until thawed (cgroup v1), so the kill above does not end it."""
        from pipeline_steps.sandbox.pool import remove_orphans

        try:
            remove_orphans(Cgroups(own=self._cgroup_paths))
        except (CgroupError, OSError) as exc:
            log.warning("could not sweep the sandbox server's cgroups: %s", exc)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main() -> int:
    """The local profile's sandbox server until Ctrl-C: state under ``$PIPELINE_HOME/sandboxes``; prints the
    ``E2B_*`` settings that reach it. Sandboxes see an allow-list, so the store and Airflow's home are out of reach
    anyway; they stay on the hide list for the case they lie inside the Python installation."""
    from pipeline_steps import settings

    home = settings.home().resolve()
    hide = [home / "store", *([os.environ["AIRFLOW_HOME"]] if os.environ.get("AIRFLOW_HOME") else [])]
    server = LocalSandboxServer(home / "sandboxes", hide=hide)
    home.mkdir(parents=True, exist_ok=True)
    with server:
        print("".join(f"export {k}={v}\n" for k, v in server.env().items()), flush=True)
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
