"""Sandboxes start when the server's Python environment lives below /tmp (a clone or a venv in /tmp).

Each sandbox gets a fresh tmpfs on /tmp, and the interpreter's directories are bound read-only into the jail. The
jail once mounted the tmpfs after binding a venv in /tmp, which hid the interpreter: every sandbox exited at start
("sandbox interpreter failed to start") and a tool run's reward stayed 0; only a fresh clone in /tmp showed it.
Here the server runs on a venv made below /tmp (the project's packages reached through a ``.pth`` file), through
the pinned E2B SDK.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")


def test_a_server_on_a_venv_below_tmp_runs_code(tmp_path, monkeypatch):
    from e2b_code_interpreter import Sandbox

    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    venv = Path(tempfile.mkdtemp(prefix="sandbox-venv-", dir="/tmp"))  # tmp_path may not be below /tmp
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        site = next((venv / "lib").glob("python3*/site-packages"))
        # this environment's packages (and the project's editable install) for the server; the jail binds only the
        # new venv and the base interpreter, which is all a sandbox's kernel needs
        (site / "outer.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        python = venv / "bin" / "python"
        monkeypatch.setattr(sys, "executable", str(python))  # the interpreter LocalSandboxServer starts the server on
        with LocalSandboxServer(tmp_path / "state", args=["--warm", "0"]) as server:
            sb = Sandbox.create(**server.sdk_options())
            try:
                out = sb.run_code("import sys; print(sys.prefix); 6 * 7")
                assert out.error is None, out.error
                assert out.results[0].text == "42"
                assert "".join(out.logs.stdout) == f"{venv}\n"  # the kernel ran on the venv below /tmp
            finally:
                sb.kill()
    finally:
        subprocess.run(["rm", "-rf", str(venv)], check=False)
