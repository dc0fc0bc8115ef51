"""The end-of-run leftover check (tests/helpers/leftovers.py) finds what a test leaks, including the processes the
old environment-only check missed: one started with a clean environment (as a retitled Airflow, Ray or PostgreSQL
process reads), and a daemon orphaned by its parent. Each case runs an inner pytest on a generated test file with the
plugin, as ``make test`` runs it, and must fail naming the leaked process; a run that leaks nothing must pass."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.helpers.listening import descendants
from tests.helpers.step_cli import ROOT

LEAKS = {
    # a child left running, environment wiped: only the tree walk finds it
    "child": "subprocess.Popen(['env', '-i', 'sleep', '{tag}'])",
    # a daemon: its parent exits at once, so it is re-parented (to pytest, the subreaper); environment wiped
    "daemon": "subprocess.run(['sh', '-c', 'env -i sleep {tag} >/dev/null 2>&1 &'], check=True)",
    # nothing leaked: a child waited for
    "none": "subprocess.run(['sleep', '0.1'], check=True)",
    # nothing leaked: multiprocessing's resource tracker, a helper of pytest's own process that ends with it
    "tracker": "from multiprocessing import resource_tracker; resource_tracker.ensure_running()",
}


def _inner_run(tmp_path, leak: str, workers: int) -> tuple[subprocess.CompletedProcess, str]:
    tag = f"{9000 + uuid.uuid4().int % 1000}.{os.getpid()}"  # a unique sleep length names the leaked process
    test = f"import subprocess\n\ndef test_leak():\n    {LEAKS[leak].format(tag=tag)}\n"
    (tmp_path / "test_leaks.py").write_text(test)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.leftovers", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"), str(tmp_path / "test_leaks.py")]
    if workers:
        cmd += ["-n", str(workers)]
    env = {**os.environ, "PIPELINE_TEST_RUN": uuid.uuid4().hex, "PIPELINE_TEST_LEFTOVER_GRACE_S": "2"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, tag


def _alive_sleeps(tag: str) -> list[int]:
    found = []
    for pid in descendants(1):
        try:
            if f"sleep\0{tag}".encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("leak,workers", [("child", 0), ("daemon", 0), ("daemon", 2)])
def test_a_leaked_process_fails_the_run_and_is_killed(tmp_path, leak, workers):
    proc, tag = _inner_run(tmp_path, leak, workers)
    try:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "1 passed" in proc.stdout, proc.stdout
        assert "were still alive" in proc.stderr and f"sleep {tag}" in proc.stderr, proc.stderr
        assert _alive_sleeps(tag) == []  # killed by the check
    finally:
        for pid in _alive_sleeps(tag):
            os.kill(pid, 9)


@pytest.mark.parametrize("leak,workers", [("none", 2), ("tracker", 0)])
def test_a_run_that_leaks_nothing_passes(tmp_path, leak, workers):
    proc, _ = _inner_run(tmp_path, leak, workers)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "still alive" not in proc.stderr
