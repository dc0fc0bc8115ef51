"""Running a pipeline step as a user does: ``python -m pipeline_steps STEP ...`` in a subprocess from the repository
root, and checking that a step refused bad input the way users should see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def run_step(*args, env=None, check=None, cwd=ROOT):
    """Run ``python -m pipeline_steps ...`` as a user would; returns (exit code, summary dict, stderr)."""
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "pipeline_steps", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=600,
    )
    lines = p.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else None
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}, stderr:\n{p.stderr[-3000:]}"
    return p.returncode, summary, p.stderr


def assert_refused(code: int, err: str, *needles: str) -> None:
    """A step refused bad input as users should see it: exit 2, one stderr line naming it, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
